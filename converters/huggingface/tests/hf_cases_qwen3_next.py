"""Tiny transformers models of the qwen3_next format with every field the converter maps away from its default,
built on the CPU by hf_cases.py (its weights: about 0.15, norm weights about 1, i.e. scales of about 2 in Qwen3-Next's
(1 + w) norms; tokens 2 × 37). flash-linear-attention is not installed here, so transformers runs its torch path of
the gated delta rule (torch_chunk_gated_delta_rule)."""

from __future__ import annotations

# case -> (format, transformers config class name, config). The transformers defaults are in the comments.
CASES = {
    "qwen3_next": (
        "qwen3_next",
        "Qwen3NextConfig",
        {
            "vocab_size": 128,
            "hidden_size": 32,
            "num_hidden_layers": 4,
            # not every 4th layer (the full_attention_interval default)
            "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            "num_attention_heads": 4,  # 16
            "num_key_value_heads": 2,
            "head_dim": 16,  # 256
            "attention_bias": True,  # False: q_proj's bias carries the output gate's too
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5},  # 0.25
            "linear_num_key_heads": 2,  # 16
            "linear_num_value_heads": 6,  # 32: three value heads per key head
            "linear_key_head_dim": 8,  # 128
            "linear_value_head_dim": 4,  # 128
            "linear_conv_kernel_dim": 3,  # 4
            "rms_norm_eps": 1e-5,  # 1e-6
            "intermediate_size": 40,
            "moe_intermediate_size": 24,
            "shared_expert_intermediate_size": 36,  # 512, not a multiple of the experts' width
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": False,  # True
            "mlp_only_layers": [2],  # []: layer 2 has a dense MLP
            "tie_word_embeddings": True,  # False
        },
    ),
}


def format_of(case: str) -> str:
    return CASES[case][0]
