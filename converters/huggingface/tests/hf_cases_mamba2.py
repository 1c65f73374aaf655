"""Tiny transformers models of the Mamba 2 formats (mamba2, bamba, nemotron_h) with every field the converter maps
away from its default, built on the CPU by hf_cases.py (its weights and tokens: 2 × 37, not a multiple of any chunk).

The time-step limits bind (the random time steps spread around them), the models have several B/C groups (where
the whole-inner and the per-group norms differ), and Bamba's attention heads rotate a quarter of their channels.
"""

from __future__ import annotations

_MAMBA_2 = {"conv_kernel": 3, "chunk_size": 16, "use_bias": True, "use_conv_bias": False}

# case -> (format, transformers config class name, config). The transformers defaults are in the comments.
CASES = {
    "mamba2": (
        "mamba2",
        "Mamba2Config",
        {
            **_MAMBA_2,
            "vocab_size": 128,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_heads": 8,
            "head_dim": 12,
            "expand": 3,  # 2
            "state_size": 8,
            "n_groups": 2,  # 8; normalized over the whole inner dimension all the same
            "layer_norm_epsilon": 1e-4,  # 1e-5, the mixers' norms too
            "time_step_limit": (0.3, 0.9),  # (0, inf)
            "tie_word_embeddings": True,  # False
        },
    ),
    "bamba": (
        "bamba",
        "BambaConfig",
        {
            "vocab_size": 128,
            "hidden_size": 32,
            "num_hidden_layers": 3,
            "attn_layer_indices": [1],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,  # hidden / heads
            "attention_bias": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 3000.0, "partial_rotary_factor": 0.25},  # 0.5
            "intermediate_size": 48,
            "mlp_bias": True,
            "mamba_n_heads": 8,
            "mamba_d_head": 12,  # "auto"
            "mamba_expand": 3,  # 2
            "mamba_n_groups": 2,  # 1
            "mamba_d_state": 8,
            "mamba_d_conv": 3,  # 4
            "mamba_chunk_size": 16,
            "mamba_conv_bias": False,  # True
            "mamba_proj_bias": True,  # False
            "time_step_limit": (0.3, 0.9),
            "rms_norm_eps": 1e-4,
            "tie_word_embeddings": True,
        },
    ),
    "nemotron_h": (
        "nemotron_h",
        "NemotronHConfig",
        {
            **_MAMBA_2,
            "vocab_size": 128,
            "hidden_size": 32,
            "layers_block_type": ["linear_attention", "mlp", "full_attention", "linear_attention", "mlp"],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 12,  # 128
            "intermediate_size": 48,
            "mlp_hidden_act": "gelu",  # relu2 (the case below)
            "mlp_bias": True,
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "n_groups": 2,  # 8; normalized per group
            "ssm_state_size": 8,
            "time_step_min": 0.3,  # 1e-3: the lower limit of the time step
            "layer_norm_epsilon": 1e-4,
        },
    ),
    # transformers 4.x's names: the pattern string, relu2, one group.
    "nemotron_h_relu2": (
        "nemotron_h",
        "NemotronHConfig",
        {
            "vocab_size": 128,
            "hidden_size": 32,
            "hybrid_override_pattern": "M*-M",
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "intermediate_size": 40,
            "mamba_num_heads": 4,
            "mamba_head_dim": 8,
            "n_groups": 1,
            "ssm_state_size": 8,
            "chunk_size": 8,
            "use_conv_bias": True,
            "layer_norm_epsilon": 1e-4,
        },
    ),
    # MoE layers: DeepSeek-V3's sigmoid router over groups of experts, ungated experts, wider shared experts.
    "nemotron_h_moe": (
        "nemotron_h",
        "NemotronHConfig",
        {
            **_MAMBA_2,
            "vocab_size": 128,
            "hidden_size": 32,
            "layers_block_type": ["linear_attention", "moe", "full_attention", "moe"],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 12,
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "n_groups": 2,
            "ssm_state_size": 8,
            "layer_norm_epsilon": 1e-4,
            "mlp_hidden_act": "gelu",  # relu2
            "n_routed_experts": 6,  # 8
            "num_experts_per_tok": 3,  # 2
            "moe_intermediate_size": 16,  # 7688
            "moe_shared_expert_intermediate_size": 32,  # 7688: two experts wide
            "n_group": 3,  # 1
            "topk_group": 2,  # 1
            "routed_scaling_factor": 2.5,  # 1.0
            "norm_topk_prob": False,  # True
        },
    ),
}


# A shared MLP of its own width, 1.5 routed experts (transformers accepts any width).
CASES["nemotron_h_moe-shared-width"] = (
    *CASES["nemotron_h_moe"][:2],
    {**CASES["nemotron_h_moe"][2], "moe_shared_expert_intermediate_size": 24},
)


def format_of(case: str) -> str:
    return CASES[case][0]
