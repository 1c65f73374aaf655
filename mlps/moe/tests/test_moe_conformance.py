"""blockzoo's conformance kit (`blockzoo_testing`) on the mixture of experts: discovery, config, shapes, packed
documents, every field, gradients, tensor parallel, generation, checkpoints, FLOPs. Expert parallelism is
test_moe_expert_parallel.py's. And its Mixtral and Qwen2-MoE converter sections (config and weights both ways,
everything claimed)."""

from blockzoo_testing import ConverterSectionConformance, MLPConformance


class TestMoEConformance(MLPConformance):
    field_exceptions = {
        "expert_parallel": "splits the experts between data-parallel ranks; one process has none (see "
        "test_moe_expert_parallel.py)",
        "routing": "top_k_softmax equals softmax_top_k with norm_topk_prob: true up to rounding (its documented "
        "meaning), and top_k_softmax refuses norm_topk_prob: false",
    }

    # The fields of sigmoid routing need it (and groups of at least two experts).
    field_changes = {
        "routing_groups": {"routing": "sigmoid_top_k", "routing_groups": 2},
        "routing_groups_per_token": {"routing": "sigmoid_top_k", "routing_groups": 2, "routing_groups_per_token": 2},
        "score_correction_bias": {"routing": "sigmoid_top_k", "score_correction_bias": True},
    }

    def config_factory(self):
        return {
            "type": "moe",
            "experts": 4,
            "experts_per_token": 2,
            "shared_experts": 1,
            "intermediate_size": 8,
            "z_loss_coefficient": 0.001,
        }


class TestMoEMixtralSectionConformance(ConverterSectionConformance):
    kind, format_name = "mlp", "mixtral"

    def config_factory(self):
        return {"type": "moe", "experts": 4, "experts_per_token": 2, "intermediate_size": 8}


class TestMoEQwen2SectionConformance(ConverterSectionConformance):
    # Shared experts with their sigmoid gate, unnormalized top-k scores.
    kind, format_name = "mlp", "qwen2_moe"

    def config_factory(self):
        return {
            "type": "moe",
            "experts": 4,
            "experts_per_token": 2,
            "intermediate_size": 8,
            "shared_experts": 1,
            "shared_expert_gate": {},
            "norm_topk_prob": False,
        }


class TestMoENemotronHSectionConformance(ConverterSectionConformance):
    # DeepSeek-V3's router (sigmoid, groups, correction bias, scale), ungated experts, wider shared experts.
    kind, format_name = "mlp", "nemotron_h"

    def config_factory(self):
        return {
            "type": "moe",
            "experts": 6,
            "experts_per_token": 3,
            "intermediate_size": 8,
            "shared_experts": 2,
            "gated": False,
            "activation": "squared_relu",
            "routing": "sigmoid_top_k",
            "norm_topk_prob": False,
            "routed_scale": 2.5,
            "routing_groups": 3,
            "routing_groups_per_token": 2,
            "score_correction_bias": True,
        }
