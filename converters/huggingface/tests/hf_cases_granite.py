"""Tiny transformers models of the Granite-4.0 hybrid format (granitemoehybrid) with every field the converter maps
away from its default (the multipliers too: 1 hides a multiplier applied twice, or not at all), built on the CPU by
hf_cases.py. The transformers defaults are in the comments."""

from __future__ import annotations

_GRANITE = {
    "vocab_size": 128,
    "hidden_size": 32,
    "num_hidden_layers": 3,
    "layer_types": ["linear_attention", "full_attention", "linear_attention"],  # all linear_attention
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "attention_bias": True,  # False
    "position_embedding_type": "rope",  # None
    "rope_parameters": {"rope_type": "default", "rope_theta": 3000.0},
    "intermediate_size": 24,
    "shared_intermediate_size": 40,  # 1024, no multiple of the experts' 24
    "num_local_experts": 4,  # 8
    "num_experts_per_tok": 3,  # 2
    "router_aux_loss_coef": 0.02,  # 0.001
    "hidden_act": "silu",  # the Mamba layers need it
    "embedding_multiplier": 3.0,  # 1
    "residual_multiplier": 0.6,  # 1
    "attention_multiplier": 0.15,  # 1 (the softmax scale itself)
    "logits_scaling": 4.0,  # 1
    "mamba_n_heads": 8,  # 128
    "mamba_d_head": 12,  # "auto"
    "mamba_expand": 3,  # 2
    "mamba_n_groups": 2,  # 1
    "mamba_d_state": 8,  # 256
    "mamba_d_conv": 3,  # 4
    "mamba_chunk_size": 16,  # 256
    "mamba_conv_bias": False,  # True
    "mamba_proj_bias": True,  # False
    "time_step_limit": (0.3, 0.9),  # (0, inf)
    "rms_norm_eps": 1e-4,  # 1e-6
    "tie_word_embeddings": True,  # False
}

# case -> (format, transformers config class name, config).
CASES = {
    "granitemoehybrid": ("granitemoehybrid", "GraniteMoeHybridConfig", _GRANITE),
    # No RoPE (the attention of Granite-4.0's released hybrids), whole shared experts of the routed width.
    "granitemoehybrid-nope": (
        "granitemoehybrid",
        "GraniteMoeHybridConfig",
        {**_GRANITE, "position_embedding_type": None, "shared_intermediate_size": 48, "tie_word_embeddings": False},
    ),
}


def format_of(case: str) -> str:
    return CASES[case][0]
