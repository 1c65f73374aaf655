"""Qwen3-Next 80B-A3B, as a preset (`presets.py` lists it): the architecture part of its config.json, its note and
the stored copies it was read against. Torch-free."""

from __future__ import annotations

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
