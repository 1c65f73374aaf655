"""Tiny transformers models of the deepseek_v3 format with every field the converter maps away from its default,
built on the CPU by hf_cases.py (its weights, tokens and randomized router correction biases).

Head sizes all differ (nope 6, rotary 4, value 5), the query is low-rank in one case and plain in the other, the
rotary pairs interleaved (DeepSeek's) or not, dense layers first then MoE layers with group-limited sigmoid routing.
"""

from __future__ import annotations

_SMALL = {
    "vocab_size": 128,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,  # must be the heads (the keys and values are per head)
    "kv_lora_rank": 8,  # 512
    "qk_nope_head_dim": 6,  # 128
    "qk_rope_head_dim": 4,  # 64
    "v_head_dim": 5,  # 128
    "intermediate_size": 48,  # 18432
    "moe_intermediate_size": 16,  # 2048
    "n_routed_experts": 6,  # 256
    "num_experts_per_tok": 3,  # 8
    "rms_norm_eps": 1e-4,  # 1e-6
}

# case -> (format, transformers config class name, config). The transformers defaults are in the comments.
CASES = {
    "deepseek_v3": (
        "deepseek_v3",
        "DeepseekV3Config",
        {
            **_SMALL,
            "num_hidden_layers": 3,
            "first_k_dense_replace": 1,  # 3
            "q_lora_rank": 12,  # 1536
            "rope_interleave": True,
            "attention_bias": True,  # False
            "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},  # 10000
            "hidden_act": "gelu",  # silu
            "n_shared_experts": 2,  # 1
            "n_group": 3,  # 8
            "topk_group": 2,  # 4
            "routed_scaling_factor": 1.5,  # 2.5
            "norm_topk_prob": False,  # True
        },
    ),
    "deepseek_v3_plain_query": (
        "deepseek_v3",
        "DeepseekV3Config",
        {
            **_SMALL,
            "num_hidden_layers": 2,
            "first_k_dense_replace": 0,  # every layer MoE
            "q_lora_rank": None,  # a plain q_proj
            "rope_interleave": False,  # True
            "tie_word_embeddings": True,  # False
            "n_shared_experts": 1,
            "n_group": 2,
            "topk_group": 1,
            "norm_topk_prob": True,
        },
    ),
    # YaRN with DeepSeek's mscale: the rotary tables and the softmax scale both change.
    "deepseek_v3_yarn": (
        "deepseek_v3",
        "DeepseekV3Config",
        {
            **_SMALL,
            "num_hidden_layers": 2,
            "first_k_dense_replace": 1,
            "q_lora_rank": 12,
            "n_group": 1,
            "topk_group": 1,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 100.0,
                "factor": 4.0,
                "original_max_position_embeddings": 8,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 0.8,
                "mscale_all_dim": 0.6,
            },
        },
    ),
}


def format_of(case: str) -> str:
    return CASES[case][0]
