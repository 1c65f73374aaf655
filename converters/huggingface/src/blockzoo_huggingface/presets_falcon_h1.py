"""Falcon-H1's published sizes, as presets (`presets.py` lists them): the architecture part of each size's config.json,
the note on what no stored copy holds and the stored copies they were read against. Torch-free."""

from __future__ import annotations

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
