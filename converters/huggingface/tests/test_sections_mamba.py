"""The sections of the Jamba format through blockzoo's conformance kit (config and weights both ways bit for bit,
every field claimed, torch-free): Jamba's Mamba with its dt/B/C norms (which need this distribution's
normalization section), attention without rotary embeddings, the MoE that never renormalizes, the dense MLP
under `feed_forward`. The Mamba plugins' own files check their other sections."""

from blockzoo_testing import ConverterSectionConformance

NORM = {"type": "rms_norm", "epsilon": 1e-5}


class TestJambaMambaSectionConformance(ConverterSectionConformance):
    kind, format_name = "mixer", "jamba"

    def config_factory(self):
        return {
            "type": "mamba",
            "state_size": 4,
            "expand": 3,
            "dt_rank": 3,
            "convolution": {"kernel_size": 3, "bias": {"enabled": False}},
            "add_linear_biases": True,
            "dt_norm": NORM,
            "b_norm": NORM,
            "c_norm": NORM,
        }


class TestJambaAttentionSectionConformance(ConverterSectionConformance):
    kind, format_name = "mixer", "jamba"

    def config_factory(self):
        return {"type": "attention", "heads": 4, "head_groups": 2, "head_size": 8, "rotary": {"type": "none"}}


class TestJambaMoESectionConformance(ConverterSectionConformance):
    kind, format_name = "mlp", "jamba"

    def config_factory(self):
        return {
            "type": "moe",
            "experts": 4,
            "experts_per_token": 3,
            "intermediate_size": 8,
            "gated": True,
            "norm_topk_prob": False,  # Jamba never renormalizes
        }


class TestJambaMLPSectionConformance(ConverterSectionConformance):
    kind, format_name = "mlp", "jamba"

    def config_factory(self):
        return {"type": "mlp", "intermediate_size": 24, "gated": True, "activation": "silu"}
