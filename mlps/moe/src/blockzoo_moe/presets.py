"""The mixture-of-experts models this plugin ships as presets (`blockzoo models`): Mixtral 8x7B, Qwen3-30B-A3B and
DeepSeek-V3 (whose attention, MLA, comes from blockzoo-mla: the preset needs both).

Each is the architecture part of the model's published config.json (the page named in `source`), read through its
Hugging Face format, so the checks compare it with transformers. The proxies are ours: the same structure with fewer
and smaller experts, for one GPU. Torch-free.
"""

from __future__ import annotations

from blockzoo.api import Preset

REQUIRES = ("blockzoo-attention", "blockzoo-moe", "blockzoo-huggingface")
DEFAULTS_TAKEN = (
    "Initialization, learning-rate scales and weight decay are blockzoo's defaults (the config.json has only "
    "initializer_range, not read); the MoE's z-loss is off (no published counterpart)."
)
PROXY_NOTE = "Ours, not a published model: the family's structure with fewer, smaller experts for one GPU. "

MIXTRAL_8X7B = {
    "model_type": "mixtral",
    "architectures": ["MixtralForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "vocab_size": 32000,
}

QWEN_3_30B_A3B = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "v_head_dim": 128,
    "vocab_size": 129280,
}
DEEPSEEK_NOTE = (
    "The multi-token-prediction layer (num_nextn_predict_layers: 1, 14B more parameters in the published 685B "
    "checkpoint) is not part of the model transformers builds, nor of this preset; the FP8 quantization of the "
    "published weights is not an architecture field. Keys of the published file transformers does not read "
    "(ep_size, aux_loss_alpha, seq_aux, moe_layer_freq, scoring_func: sigmoid, topk_method: noaux_tc) are left "
    "out: the format implies sigmoid scoring with the bias-corrected group routing."
)


# Stored copies of the published values (`checked_against`): where each was read, and what it confirms. Every
# architecture key of each preset agrees with them.
STORED_MIXTRAL = (
    "github.com/AI-Hypercomputer/torchprime torchprime/torch_xla_models/configs/model/mixtral-8x7b.yaml@1504a885 "
    "(tokenizer mistralai/Mixtral-8x7B-v0.1: width, MLP width, 32768 positions, heads, 8 experts / 2 per token, "
    "layers, KV heads, eps 1e-5, RoPE base 1e6, router_aux_loss_coef 0.02, vocabulary)",
    "github.com/Azure/azureml-assets assets/models/system/mistralai-Mixtral-8x7B-Instruct-v01/description.md "
    "(46.7B parameters, 12.9B per token)",
)
STORED_QWEN_3_30B_A3B = (
    "github.com/citsjtu2020/LLM-Prof sglang/Model_Config.md@8434c8d1 (the config.json of Qwen3-30B-A3B, verbatim: "
    "every architecture key)",
)
STORED_DEEPSEEK = (
    "the config.json of deepseek-ai/DeepSeek-V3 quoted in full in a vLLM-on-Ascend bug report (every key, among "
    "them the yarn rope_scaling, 163840 positions, scoring_func sigmoid, topk_method noaux_tc, "
    "num_nextn_predict_layers 1); found by exact-string search, repository not named there",
    "github.com/AI-Hypercomputer/torchprime torchprime/torch_xla_models/configs/model/deepseek-v3.yaml@5462afe8 "
    "(widths, 61 layers, heads, experts, routing groups, MLA ranks and head sizes; its positions and RoPE are not "
    "the published ones)",
    "github.com/deepseek-ai/DeepSeek-V3 README_WEIGHTS.md@0b39205a (671B main-model parameters in 61 layers, the "
    "MTP module counted apart)",
)


def _published(family, repository, config, parameters, active, published, *, requires=REQUIRES, notes="", checked):
    notes = " ".join(filter(None, (notes, DEFAULTS_TAKEN)))
    fields = {"requires": requires, "active_parameters": active, "notes": notes, "checked_against": checked}
    return Preset.published(family, repository, config, parameters, published, **fields)


def _proxy(family, base_name, base, parameters, active, *, requires=REQUIRES, **changes):
    fields = {"requires": requires, "active_parameters": active, "notes": PROXY_NOTE + DEFAULTS_TAKEN}
    return Preset.proxy(family, base_name, base, parameters, changes=changes, **fields)


MLA_REQUIRES = ("blockzoo-mla", "blockzoo-mlp", *REQUIRES)


def presets() -> dict[str, Preset]:
    return {
        "mixtral_8x7b": _published(
            "Mixtral",
            "mistralai/Mixtral-8x7B-v0.1",
            MIXTRAL_8X7B,
            46_702_792_704,
            12_879_925_248,
            "46.7B (12.9B active)",
            checked=STORED_MIXTRAL,
        ),
        "qwen3_30b_a3b": _published(
            "Qwen3",
            "Qwen/Qwen3-30B-A3B",
            QWEN_3_30B_A3B,
            30_532_122_624,
            3_353_032_704,
            "30.5B (3.3B active)",
            checked=STORED_QWEN_3_30B_A3B,
        ),
        "deepseek_v3": _published(
            "DeepSeek-V3",
            "deepseek-ai/DeepSeek-V3",
            DEEPSEEK_V3,
            671_026_419_200,
            37_552_297_472,
            "671B (37B active)",
            requires=MLA_REQUIRES,
            notes=DEEPSEEK_NOTE,
            checked=STORED_DEEPSEEK,
        ),
        "mixtral_proxy_520m": _proxy(
            "Mixtral",
            "mixtral_8x7b",
            MIXTRAL_8X7B,
            521_104_128,
            181_365_504,
            hidden_size=768,
            intermediate_size=2048,
            num_attention_heads=12,
            num_key_value_heads=4,
            num_hidden_layers=12,
        ),
        "qwen3_moe_proxy_330m": _proxy(
            "Qwen3",
            "qwen3_30b_a3b",
            QWEN_3_30B_A3B,
            325_664_256,
            193_543_680,
            hidden_size=512,
            intermediate_size=1536,
            moe_intermediate_size=256,
            num_attention_heads=8,
            num_key_value_heads=4,
            num_experts=32,
            num_experts_per_tok=4,
            num_hidden_layers=12,
        ),
        "deepseek_v3_proxy_440m": _proxy(
            "DeepSeek-V3",
            "deepseek_v3",
            DEEPSEEK_V3,
            440_994_400,
            259_328_608,
            requires=MLA_REQUIRES,
            hidden_size=768,
            intermediate_size=2048,
            moe_intermediate_size=256,
            first_k_dense_replace=1,
            n_routed_experts=32,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=4,
            num_attention_heads=12,
            num_key_value_heads=12,
            q_lora_rank=384,
            kv_lora_rank=256,
            qk_nope_head_dim=64,
            qk_rope_head_dim=32,
            v_head_dim=64,
            num_hidden_layers=12,
        ),
    }


def register_presets(register) -> None:
    for name, preset in presets().items():
        register(name, preset)
