"""The hybrid models shipped as presets (`blockzoo models`): Falcon-H1, Nemotron-H, Granite 4.0 H and Qwen3-Next. They
live here, beside their formats: each combines layers of several plugins (attention, Mamba 2 or Gated DeltaNet, MLP or
MoE) that only its format ties together. Each is the architecture part of its published config.json. Torch-free."""

from __future__ import annotations

from blockzoo.api import Preset

HF = "blockzoo-huggingface"
DEFAULTS_TAKEN = (
    "Initialization, learning-rate scales and weight decay are blockzoo's defaults (the config.json has only "
    "initializer_range, not read)."
)

# -- Falcon-H1: attention and Mamba 2 side by side in every layer, then the MLP; µP multipliers throughout.

_FALCON_H1 = {
    "model_type": "falcon_h1",
    "architectures": ["FalconH1ForCausalLM"],
    "attention_bias": False,
    "hidden_act": "silu",
    "mamba_chunk_size": 128,
    "mamba_conv_bias": True,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_n_groups": 1,
    "mamba_norm_before_gate": False,
    "mamba_proj_bias": False,
    "mamba_rms_norm": False,
    "mlp_bias": False,
    "num_key_value_heads": 2,
    "projectors_bias": False,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 100000000000.0,
    "tie_word_embeddings": False,
}
FALCON_H1_0_5B = {
    **_FALCON_H1,
    "attention_in_multiplier": 1.0,
    "attention_out_multiplier": 0.9375,
    "embedding_multiplier": 5.656854249492381,
    "head_dim": 64,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "key_multiplier": 0.39062499999999994,
    "lm_head_multiplier": 0.0390625,
    "mamba_d_head": 64,
    "mamba_d_ssm": 1536,
    "mamba_d_state": 128,
    "mamba_n_heads": 24,
    "max_position_embeddings": 16384,
    "mlp_multipliers": [0.8838834764831844, 0.5859375],
    "num_attention_heads": 8,
    "num_hidden_layers": 36,
    "ssm_in_multiplier": 1.25,
    "ssm_multipliers": [0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
    "ssm_out_multiplier": 0.23570226039551587,
    "vocab_size": 32784,
}
# The larger sizes normalize Mamba 2's output (gate, then a gated RMSNorm), where 0.5B has no norm; their µP
# multipliers are not transcribed (see FALCON_NOTE).
_FALCON_H1_NORMED = {**_FALCON_H1, "mamba_norm_before_gate": False, "mamba_rms_norm": True}
FALCON_H1_1_5B = {
    **_FALCON_H1_NORMED,
    "head_dim": 128,
    "hidden_size": 2048,
    "intermediate_size": 4608,
    "mamba_d_head": 64,
    "mamba_d_ssm": 3072,
    "mamba_d_state": 256,
    "mamba_n_heads": 48,
    "max_position_embeddings": 131072,
    "num_attention_heads": 8,
    "num_hidden_layers": 24,
    "vocab_size": 65536,
}
FALCON_H1_1_5B_DEEP = {
    **_FALCON_H1_NORMED,
    "head_dim": 128,
    "hidden_size": 1280,
    "intermediate_size": 3072,
    "mamba_d_head": 64,
    "mamba_d_ssm": 1536,
    "mamba_d_state": 256,
    "mamba_n_heads": 24,
    "max_position_embeddings": 131072,
    "num_attention_heads": 6,
    "num_hidden_layers": 66,
    "vocab_size": 65536,
}
FALCON_H1_3B = {
    **_FALCON_H1_NORMED,
    "head_dim": 128,
    "hidden_size": 2560,
    "intermediate_size": 6144,
    "mamba_d_head": 128,
    "mamba_d_ssm": 4096,
    "mamba_d_state": 256,
    "mamba_n_heads": 32,
    "max_position_embeddings": 131072,
    "num_attention_heads": 10,
    "num_hidden_layers": 32,
    "vocab_size": 65536,
}
FALCON_H1_7B = {
    **_FALCON_H1_NORMED,
    "head_dim": 128,
    "hidden_size": 3072,
    "intermediate_size": 12288,
    "mamba_d_head": 128,
    "mamba_d_ssm": 3072,
    "mamba_d_state": 256,
    "mamba_n_heads": 24,
    "max_position_embeddings": 262144,
    "num_attention_heads": 12,
    "num_hidden_layers": 44,
    "vocab_size": 130048,
}
FALCON_REQUIRES = ("blockzoo-attention", "blockzoo-mamba-2", "blockzoo-mlp", HF)
FALCON_NOTE = (
    "The µP multipliers of this size (embedding, lm_head, attention/SSM in and out, key, MLP, SSM) were found in no "
    "stored copy of its config.json (only the 0.5B's are stored): transformers' defaults (1.0) are taken. They change "
    "no parameter count, and a model started from the published checkpoint (`model.pretrained`) reads its own; "
    "training from scratch with them at 1.0 is not the published recipe. The shapes, vocabulary (65536 for the base "
    "1.5B, 1.5B-Deep and 3B; the instruct checkpoints add one token), the Mamba output norm (`mamba_rms_norm: true`, "
    "gate then normalize) and the rest are those of the stored copies below."
)
# Stored copies of the published values (see `checked_against`): where each was read, and what it confirms.
STORED_FALCON_0_5B = (
    "a Megatron-Bridge unit-test fixture, FALCON_H1_500M_CONFIG (the tiiuae/Falcon-H1-0.5B config.json: every "
    "architecture key and µP multiplier; found by exact-string search, repository not named there)"
)
STORED_FALCON_SWEEP = (
    "'Falcon H1 Transformers Audit' (a survey that read each tiiuae/Falcon-H1 config.json raw: per checkpoint the "
    "layers, width, MLP width, vocabulary, attention heads/KV/head_dim, Mamba heads/head_dim/d_ssm, groups, state, "
    "context, chunk size, and whether the Mamba output is RMS-normalized; found by exact-string search, repository "
    "not named there)"
)
STORED_FALCON_DOC = (
    "transformers' Falcon-H1 documentation table (docs/source/en/model_doc/falcon_h1.md, copied in "
    "github.com/roboalchemist/llm-code-docs docs/llms-txt/huggingface-transformers/falcon_h1.md: depth, width, "
    "heads, KV heads, Mamba heads, head sizes, state, context)"
)
STORED_FALCON_NORM = (
    "a transformers GGUF loader patch for tiiuae/Falcon-H1R-7B ('mamba_rms_norm: True, mamba_norm_before_gate: "
    "False: actual trained model uses'); found by exact-string search"
)

# -- Nemotron-H 8B: Mamba 2, attention and MLP layers laid out by a pattern.

NEMOTRON_H_8B = {
    "model_type": "nemotron_h",
    "architectures": ["NemotronHForCausalLM"],
    "attention_bias": False,
    "chunk_size": 128,
    "conv_kernel": 4,
    "expand": 2,
    "head_dim": 128,
    "hidden_size": 4096,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "intermediate_size": 21504,
    "layer_norm_epsilon": 1e-05,
    "mamba_head_dim": 64,
    "mamba_hidden_act": "silu",
    "mamba_num_heads": 128,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "mlp_hidden_act": "relu2",
    "n_groups": 8,
    "num_attention_heads": 32,
    "num_hidden_layers": 52,
    "num_key_value_heads": 8,
    "residual_in_fp32": False,
    "ssm_state_size": 128,
    "tie_word_embeddings": False,
    "use_bias": False,
    "use_conv_bias": True,
    "vocab_size": 131072,
}

NEMOTRON_NOTE = (
    "The published file names the attention head size attention_head_dim (128; the remote code of transformers 4 "
    "read that key), which transformers 5 reads as head_dim: written here as head_dim, the same value."
)
STORED_NEMOTRON = (
    "a Megatron-Bridge NemotronH bridge test fixture, nemotronh_8b_config_dict (the nvidia/Nemotron-H-8B-Base-8K "
    "config.json: every architecture key, chunk_size 128, 8192 positions, layer_norm_epsilon 1e-5, "
    "residual_in_fp32 false, use_conv_bias true, attention_head_dim 128); found by exact-string search, repository "
    "not named there",
    "github.com/pufanyi/Megatron-Bridge src/megatron/bridge/models/nemotronh/nemotron_h_provider.py@af52e856 "
    "(NemotronHModelProvider8B: pattern, 52 layers, width 4096, 32 heads, 8 KV groups, FFN 21504, 128 Mamba heads of "
    "64, state 128, 8 groups, squared ReLU, 8192 positions)",
    "NVIDIA's configuration_nemotron_h.py shipped with the checkpoint (vLLM's copy, "
    "github.com/jiayingsong2023/litevLLM vllm/transformers_utils/configs/nemotron_h.py: defaults documented as "
    "NemotronH-v0.1, vocabulary 131072, untied, head_dim 128, layer_norm_epsilon 1e-5, conv 4, expand 2)",
)

# -- Granite 4.0 H-Tiny: Mamba 2 and attention (no position embedding) layers, each followed by a MoE with a shared
# expert; Granite's multipliers.

GRANITE_4_0_H_TINY = {
    "model_type": "granitemoehybrid",
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "attention_bias": False,
    "attention_multiplier": 0.0078125,
    "embedding_multiplier": 12,
    "hidden_act": "silu",
    "hidden_size": 1536,
    "intermediate_size": 512,
    "layer_types": ["mamba"] * 5 + ["attention"] + (["mamba"] * 9 + ["attention"]) * 3 + ["mamba"] * 4,
    "logits_scaling": 6,
    "mamba_chunk_size": 256,
    "mamba_conv_bias": True,
    "mamba_d_conv": 4,
    "mamba_d_head": 64,
    "mamba_d_state": 128,
    "mamba_expand": 2,
    "mamba_n_groups": 1,
    "mamba_n_heads": 48,
    "mamba_proj_bias": False,
    "max_position_embeddings": 131072,
    "num_attention_heads": 12,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 40,
    "num_key_value_heads": 4,
    "num_local_experts": 64,
    "position_embedding_type": None,  # published: "nope" (no position embedding), which transformers reads as None
    "residual_multiplier": 0.22,
    "rms_norm_eps": 1e-05,
    "router_aux_loss_coef": 0.0,
    "shared_intermediate_size": 1024,
    "tie_word_embeddings": True,
    "vocab_size": 100352,
}
GRANITE_NOTE = (
    "The published normalization_function (rmsnorm) is left out: the format implies it. Attention at layers 5, 15, "
    "25 and 35 (the stored copies below agree)."
)
STORED_GRANITE = (
    "a model-matrix test fixture GRANITE_H_TINY_HF (ibm-granite/granite-4.0-h-tiny: width, depth, heads, KV heads, "
    "expert and shared widths, 64 experts / 6 per token, vocabulary, tying, Mamba heads/head size/state/groups/"
    "expand/conv/chunk, context, and layer_types with attention at 5, 15, 25, 35); found by exact-string search",
    "github.com/quandvucl/granite-4-ttnn granite/config.py@3c798503 (the tiny's width 1536, 40 layers, 12 heads, 4 "
    "KV heads, residual_multiplier 0.22, attention layers [5, 15, 25, 35])",
    "a shard server's manifest for ibm-granite/granite-4.0-h-tiny (embedding_multiplier 12.0, logits_scaling 6.0, "
    "rms_norm_eps 1e-5, vocabulary 100352, 64 experts, 6 per token, expert width 512); found by exact-string search",
    "a Granite switch test naming 0.0078125 the attention_multiplier of granite-4.0-h-1b/tiny/small; found by "
    "exact-string search",
)

# -- Qwen3-Next 80B-A3B: Gated DeltaNet and gated attention (3:1), every layer a MoE with a gated shared expert.

QWEN_3_NEXT_80B_A3B = {
    "model_type": "qwen3_next",
    "architectures": ["Qwen3NextForCausalLM"],
    "decoder_sparse_step": 1,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "mlp_only_layers": [],
    "moe_intermediate_size": 512,
    "norm_topk_prob": True,
    "num_attention_heads": 16,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "num_hidden_layers": 48,
    "num_key_value_heads": 2,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000000,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
}
QWEN_NEXT_NOTE = (
    "The multi-token-prediction layer of the published checkpoint is not part of the model transformers builds, nor "
    "of this preset. intermediate_size (5120) is used by no layer: every layer is a MoE (mlp_only_layers is empty)."
)
STORED_QWEN_NEXT = (
    "a stored model-card dump '# Qwen/Qwen3-Next-80B-A3B-Instruct / model config' (the config.json: head_dim 256, "
    "width 2048, intermediate_size 5120, linear-attention heads and sizes, max_position_embeddings 262144, "
    "full_attention_interval 4, mlp_only_layers [], moe_intermediate_size 512); found by code search, repository not "
    "named there",
    "a test fixture at Qwen/Qwen3-Next-80B-A3B-Instruct revision 9c7f2fbe (rope_theta 1e7, partial_rotary_factor "
    "0.25, dense width 2.5x hidden = 5120, expert and shared widths 512, 16 q / 2 KV heads, 512 experts / 10 per "
    "token, rms_norm_eps 1e-6, untied); found by exact-string search",
    "github.com/xorbitsai/inference doc/source/models/builtin/llm/qwen3-next-instruct.rst (context length 262144)",
    "a parameter-count test naming 79,674,391,296 parameters and 3,874,929,408 active for Qwen/Qwen3-Coder-Next, "
    "the same architecture (the counts of this preset); found by exact-string search",
    "transformers 5.25 models/qwen3_next/configuration_qwen3_next.py (its defaults, documented for "
    "Qwen/Qwen3-Next-80B-A3B-Instruct, but intermediate_size 5632 and max_position_embeddings 32768 there are not "
    "the published values)",
)


def _published(family, repository, config, parameters, published, requires, *, active=None, notes="", checked=()):
    fields = {
        "requires": requires,
        "active_parameters": active,
        "notes": " ".join(filter(None, (notes, DEFAULTS_TAKEN))),
        "checked_against": tuple(checked),
    }
    return Preset.published(family, repository, config, parameters, published, **fields)


def _proxy(family, base_name, base, parameters, requires, *, active=None, **changes):
    notes = "Ours, not a published model: the family's structure at a size for one GPU. " + DEFAULTS_TAKEN
    fields = {"requires": requires, "active_parameters": active, "notes": notes}
    return Preset.proxy(family, base_name, base, parameters, changes=changes, **fields)


NEMOTRON_REQUIRES = ("blockzoo-attention", "blockzoo-mamba-2", "blockzoo-mlp", HF)
GRANITE_REQUIRES = ("blockzoo-attention", "blockzoo-mamba-2", "blockzoo-moe", HF)
QWEN_NEXT_REQUIRES = ("blockzoo-attention", "blockzoo-gated-delta-net", "blockzoo-moe", HF)


def presets() -> dict[str, Preset]:
    falcon = dict(requires=FALCON_REQUIRES)
    larger_falcon = dict(
        falcon, notes=FALCON_NOTE, checked=(STORED_FALCON_SWEEP, STORED_FALCON_DOC, STORED_FALCON_NORM)
    )
    return {
        "falcon_h1_0_5b": _published(
            "Falcon-H1",
            "tiiuae/Falcon-H1-0.5B-Base",
            FALCON_H1_0_5B,
            521_411_104,
            "0.5B",
            checked=(STORED_FALCON_0_5B, STORED_FALCON_SWEEP, STORED_FALCON_DOC),
            **falcon,
        ),
        "falcon_h1_1_5b": _published(
            "Falcon-H1", "tiiuae/Falcon-H1-1.5B-Base", FALCON_H1_1_5B, 1_554_859_392, "1.5B", **larger_falcon
        ),
        "falcon_h1_1_5b_deep": _published(
            "Falcon-H1", "tiiuae/Falcon-H1-1.5B-Deep-Base", FALCON_H1_1_5B_DEEP, 1_554_872_208, "1.5B", **larger_falcon
        ),
        "falcon_h1_3b": _published(
            "Falcon-H1", "tiiuae/Falcon-H1-3B-Base", FALCON_H1_3B, 3_149_387_264, "3B", **larger_falcon
        ),
        "falcon_h1_7b": _published(
            "Falcon-H1", "tiiuae/Falcon-H1-7B-Base", FALCON_H1_7B, 7_585_648_736, "7B", **larger_falcon
        ),
        "nemotron_h_8b": _published(
            "Nemotron-H",
            "nvidia/Nemotron-H-8B-Base-8K",
            NEMOTRON_H_8B,
            8_100_852_736,
            "8B",
            NEMOTRON_REQUIRES,
            notes=NEMOTRON_NOTE,
            checked=STORED_NEMOTRON,
        ),
        "granite_4_0_h_tiny": _published(
            "Granite 4.0",
            "ibm-granite/granite-4.0-h-tiny",
            GRANITE_4_0_H_TINY,
            6_939_037_248,
            "7B (1B active)",
            GRANITE_REQUIRES,
            active=1_465_470_528,
            notes=GRANITE_NOTE,
            checked=STORED_GRANITE,
        ),
        "qwen3_next_80b_a3b": _published(
            "Qwen3-Next",
            "Qwen/Qwen3-Next-80B-A3B-Instruct",
            QWEN_3_NEXT_80B_A3B,
            79_674_391_296,
            "80B (3B active)",
            QWEN_NEXT_REQUIRES,
            active=3_874_929_408,
            notes=QWEN_NEXT_NOTE,
            checked=STORED_QWEN_NEXT,
        ),
        "falcon_h1_proxy_75m": _proxy(
            "Falcon-H1",
            "falcon_h1_0_5b",
            FALCON_H1_0_5B,
            73_040_816,
            FALCON_REQUIRES,
            hidden_size=512,
            intermediate_size=1024,
            num_attention_heads=4,
            mamba_n_heads=12,
            mamba_d_ssm=768,
            num_hidden_layers=12,
        ),
        "nemotron_h_proxy_260m": _proxy(
            "Nemotron-H",
            "nemotron_h_8b",
            NEMOTRON_H_8B,
            263_694_000,
            NEMOTRON_REQUIRES,
            hidden_size=768,
            intermediate_size=3072,
            num_attention_heads=12,
            num_key_value_heads=4,
            head_dim=64,
            mamba_num_heads=24,
            hybrid_override_pattern="M-M-M*-M-M-M*-",
            num_hidden_layers=14,
        ),
        "granite_4_0_h_proxy_370m": _proxy(
            "Granite 4.0",
            "granite_4_0_h_tiny",
            GRANITE_4_0_H_TINY,
            372_832_208,
            GRANITE_REQUIRES,
            active=202_962_896,
            hidden_size=768,
            num_attention_heads=12,
            mamba_n_heads=24,
            num_local_experts=16,
            num_experts_per_tok=4,
            layer_types=["mamba"] * 5 + ["attention"] + ["mamba"] * 5 + ["attention"],
            num_hidden_layers=12,
        ),
        "qwen3_next_proxy_320m": _proxy(
            "Qwen3-Next",
            "qwen3_next_80b_a3b",
            QWEN_3_NEXT_80B_A3B,
            324_206_544,
            QWEN_NEXT_REQUIRES,
            active=192_085_968,
            hidden_size=512,
            num_attention_heads=4,
            head_dim=128,
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            num_experts=32,
            num_experts_per_tok=4,
            moe_intermediate_size=256,
            shared_expert_intermediate_size=256,
            num_hidden_layers=12,
        ),
    }


def register_presets(register) -> None:
    for name, preset in presets().items():
        register(name, preset)
