"""Tiny transformers models of the Falcon-H1 format (falcon_h1) with every field the converter maps away from its
default (every μP multiplier too: 1 hides a multiplier applied twice, or not at all), built on the CPU by
hf_cases.py. The transformers defaults are in the comments."""

from __future__ import annotations

_FALCON_H1 = {
    "vocab_size": 128,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # 8
    "head_dim": 12,  # hidden_size / heads = 8
    "attention_bias": True,  # False
    "rope_parameters": {"rope_type": "default", "rope_theta": 3000.0},
    "intermediate_size": 24,
    "mlp_bias": True,  # False
    "hidden_act": "silu",  # the Mamba layers need it
    "mamba_d_ssm": 48,  # 1024 (not mamba_expand · hidden_size = 64)
    "mamba_n_heads": 6,  # 128
    "mamba_d_head": 8,  # "auto"
    "mamba_n_groups": 2,  # 1
    "mamba_d_state": 8,  # 256
    "mamba_d_conv": 3,  # 4
    "mamba_chunk_size": 16,  # 256
    "mamba_conv_bias": False,  # True
    "mamba_proj_bias": True,  # False
    "projectors_bias": False,  # False: in_proj's bias without out_proj's
    "mamba_rms_norm": True,  # False (no norm: the case falcon_h1-no-mamba-norm)
    "mamba_norm_before_gate": False,  # True (normalize, then gate: the case falcon_h1-norm-before-gate)
    "time_step_limit": (0.3, 0.9),  # (0, inf)
    "rms_norm_eps": 1e-4,  # 1e-5
    "tie_word_embeddings": True,  # False
    "embedding_multiplier": 3.0,  # 1
    "lm_head_multiplier": 0.25,  # 1
    "attention_in_multiplier": 0.8,  # 1
    "attention_out_multiplier": 1.3,  # 1
    "key_multiplier": 0.7,  # 1
    "ssm_in_multiplier": 1.2,  # 1
    "ssm_out_multiplier": 0.6,  # 1
    "ssm_multipliers": [0.5, 1.5, 0.7, 1.1, 0.9],  # [1, 1, 1, 1, 1]: z, x, B, C, dt
    "mlp_multipliers": [0.8, 1.4],  # [1, 1]: gate, down
}

# case -> (format, transformers config class name, config).
CASES = {
    "falcon_h1": ("falcon_h1", "FalconH1Config", _FALCON_H1),
    # out_proj's bias without in_proj's, untied head, no explicit head_dim (hidden / heads), one Mamba group.
    "falcon_h1-projectors-bias": (
        "falcon_h1",
        "FalconH1Config",
        {
            **{key: value for key, value in _FALCON_H1.items() if key != "head_dim"},
            "mamba_proj_bias": False,
            "projectors_bias": True,
            "mamba_n_groups": 1,
            "tie_word_embeddings": False,
        },
    ),
    # No output norm (transformers' default): y · silu(z) straight to out_proj, no norm weight in the checkpoint.
    # `mamba_norm_before_gate` keeps its default (true), which transformers reads only with the norm.
    "falcon_h1-no-mamba-norm": (
        "falcon_h1",
        "FalconH1Config",
        {**_FALCON_H1, "mamba_rms_norm": False, "mamba_norm_before_gate": True},
    ),
    # The norm first, then the gate: RMSNorm(y) · weight · silu(z) (FalconH1RMSNormGated's default order).
    "falcon_h1-norm-before-gate": (
        "falcon_h1",
        "FalconH1Config",
        {**_FALCON_H1, "mamba_rms_norm": True, "mamba_norm_before_gate": True},
    ),
}


def format_of(case: str) -> str:
    return CASES[case][0]
