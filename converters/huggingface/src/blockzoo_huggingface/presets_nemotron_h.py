"""Nemotron-H 8B, as a preset (`presets.py` lists it): the architecture part of its config.json, its note and the
stored copies it was read against. Torch-free."""

from __future__ import annotations

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
