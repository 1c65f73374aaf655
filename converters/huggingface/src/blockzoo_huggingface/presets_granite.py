"""Granite 4.0 H-Tiny, as a preset (`presets.py` lists it): the architecture part of its config.json, its note and
the stored copies it was read against. Torch-free."""

from __future__ import annotations

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
