"""The Mamba 1 formats' cases: tiny random transformers models of `mamba` and `jamba` (every mapped field away from
its default), and Apriel hybrid SSM checkpoints written by hand (their modelling code is remote and CUDA-only),
with the config.json their config class writes under transformers 4.53 and their tensor names and shapes."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

# case -> (format, transformers config class name, config). The defaults are in the comments.
CASES = {
    "mamba": (
        "mamba",
        "MambaConfig",
        {
            "vocab_size": 128,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "state_size": 8,  # 16
            "expand": 3,  # 2
            "conv_kernel": 3,  # 4
            "use_bias": True,
            "use_conv_bias": False,
            "time_step_rank": 5,  # auto: 4
            "time_step_scale": 0.5,
            "time_step_init_scheme": "constant",
            "time_step_min": 0.002,
            "time_step_max": 0.2,
            "time_step_floor": 2e-4,
            "layer_norm_epsilon": 1e-4,  # 1e-5
            "tie_word_embeddings": False,
            "residual_in_fp32": False,  # not carried: the same in fp32
            # hidden_act: silu, the only activation of blockzoo's mamba convolution
        },
    ),
    "jamba": (
        "jamba",
        "JambaConfig",
        {
            "vocab_size": 128,
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 96,
            "rms_norm_eps": 1e-5,  # 1e-6
            "tie_word_embeddings": True,
            # layers: mamba + moe, mamba + mlp, attention + moe, mamba + mlp
            "attn_layer_period": 3,  # 8
            "attn_layer_offset": 2,  # 4
            "expert_layer_period": 2,
            "expert_layer_offset": 0,  # 1
            "num_experts": 4,  # 16
            "num_experts_per_tok": 3,  # 2
            "router_aux_loss_coef": 0.02,  # 0.001
            "mamba_d_state": 8,  # 16
            "mamba_d_conv": 3,  # 4
            "mamba_expand": 3,  # 2
            "mamba_dt_rank": 5,  # auto: 4
            "mamba_conv_bias": False,
            "mamba_proj_bias": True,
        },
    ),
}


# Apriel hybrid SSM: case -> the config.json their config class writes (transformers 4.53, Mistral's keys).
_APRIEL_BASE = {
    "architectures": ["AprielHybridSSMForCausalLM"],
    "model_type": "apriel_hybrid_ssm",
    "auto_map": {
        "AutoConfig": "configuration_apriel_hybrid_ssm.AprielHybridSSMConfig",
        "AutoModel": "modeling_apriel_hybrid_ssm.AprielHybridSSMModel",
        "AutoModelForCausalLM": "modeling_apriel_hybrid_ssm.AprielHybridSSMForCausalLM",
    },
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "use_cache": True,
    "torch_dtype": "float32",
    "transformers_version": "4.53.2",
}
APRIEL_CASES = {
    # Every layer code; every mapped key away from its default (their ssm_config_default in the comments).
    "apriel": {
        **_APRIEL_BASE,
        "hybrid_block_layout": ["t", "m2", "m2d", "i", "m2"],
        "num_hidden_layers": 5,
        "head_dim": 24,  # hidden / heads: 16
        "hidden_act": "gelu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 20000.0,
        "sliding_window": 6,  # 4096
        "tie_word_embeddings": False,
        "ssm_cfg": {
            "d_state": 8,  # 64
            "n_v_heads": 8,  # 32
            "n_qk_heads": 2,  # 32
            "expand": 1,  # read only without d_inner
            "chunk_size": 16,  # 128
            "activation": "silu",  # identity
            "bias": True,
            "d_conv": 3,  # 4
            "d_inner": 128,  # 4096
            "d_xb": 32,  # None: the hidden size
            "dt_rank": 6,  # auto: 4
            "dt_min": 0.002,
            "dt_max": 0.2,
            "dt_init": "constant",
            "dt_scale": 0.5,
            "dt_init_floor": 2e-4,
            "conv_bias": False,
            "dt_proj_bias": True,  # their code needs the bias
            "repeat_kv_before_conv": False,
        },
    },
    # The other branches: sizes from expand and the hidden size, z_bias (no in_proj bias), tied, no window.
    "apriel_implicit_sizes": {
        **_APRIEL_BASE,
        "hybrid_block_layout": ["m2d", "t", "m2"],
        "num_hidden_layers": 3,
        "head_dim": 16,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "ssm_cfg": {
            "d_state": 16,
            "n_v_heads": 8,
            "n_qk_heads": 8,
            "expand": 2,
            "chunk_size": 128,
            "activation": "identity",
            "bias": False,
            "d_conv": 4,
            "d_inner": None,
            "d_xb": None,
            "dt_rank": "auto",
            "dt_min": 0.001,
            "dt_max": 0.1,
            "dt_init": "random",
            "dt_scale": 1.0,
            "dt_init_floor": 1e-4,
            "conv_bias": True,
            "dt_proj_bias": True,
            "repeat_kv_before_conv": True,
        },
    },
    # Attention layers only: their model is then Mistral's, the check of the float64 reference.
    "apriel_attention_only": {
        **_APRIEL_BASE,
        "hybrid_block_layout": ["t", "t"],
        "num_hidden_layers": 2,
        "head_dim": 24,
        "hidden_act": "gelu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 20000.0,
        "sliding_window": 6,
        "tie_word_embeddings": False,
        "ssm_cfg": {},
    },
}


def apriel_sizes(config: dict) -> dict[str, int]:
    """The sizes their modelling code derives from the config (`ssm_cfg` completed with its defaults)."""
    from blockzoo_huggingface.formats_mamba import APRIEL_SSM_DEFAULTS

    ssm = {**APRIEL_SSM_DEFAULTS, **config["ssm_cfg"]}
    hidden = config["hidden_size"]
    return {
        "hidden": hidden,
        "inner": ssm["d_inner"] if ssm["d_inner"] is not None else ssm["expand"] * hidden,
        "xb": ssm["d_xb"] if ssm["d_xb"] is not None else hidden,
        "state": ssm["d_state"],
        "kernel": ssm["d_conv"],
        "dt_rank": -(-hidden // 16) if ssm["dt_rank"] == "auto" else ssm["dt_rank"],
        "v_heads": ssm["n_v_heads"],
        "qk_heads": ssm["n_qk_heads"],
        "heads": config["num_attention_heads"],
        "kv_heads": config["num_key_value_heads"],
        "head_dim": config["head_dim"],
        "intermediate": config["intermediate_size"],
    }


def apriel_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of their model: names and shapes from their modules (Mistral's layers, `Mamba2`,
    `DiscreteMamba2`)."""
    from blockzoo_huggingface.formats_mamba import APRIEL_SSM_DEFAULTS

    s = apriel_sizes(config)
    ssm = {**APRIEL_SSM_DEFAULTS, **config["ssm_cfg"]}
    bias, conv_bias = ssm["bias"], ssm["conv_bias"]
    hidden, inner = s["hidden"], s["inner"]
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    for index, code in enumerate(config["hybrid_block_layout"]):
        if code == "i":
            continue
        layer = f"model.layers.{index}"
        shapes[f"{layer}.input_layernorm.weight"] = (hidden,)
        shapes[f"{layer}.post_attention_layernorm.weight"] = (hidden,)
        for name, shape in {
            "gate_proj": (s["intermediate"], hidden),
            "up_proj": (s["intermediate"], hidden),
            "down_proj": (hidden, s["intermediate"]),
        }.items():
            shapes[f"{layer}.mlp.{name}.weight"] = shape
        mixer = {}
        if code == "t":
            q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
            for name, shape in {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden)}.items():
                shapes[f"{layer}.self_attn.{name}.weight"] = shape
            shapes[f"{layer}.self_attn.o_proj.weight"] = (hidden, q)
        elif code == "m2":
            channels = inner if ssm["repeat_kv_before_conv"] else s["xb"]
            mixer = {
                "in_proj.weight": (2 * inner + 2 * s["xb"], hidden),
                "dt_in_proj.weight": (s["dt_rank"], hidden),
                "dt_proj.weight": (inner, s["dt_rank"]),
                "dt_proj.bias": (inner,),
                "conv1d.weight": (channels, 1, s["kernel"]),
                "A_log": (inner, s["state"]),
                "D": (inner,),
                "out_proj.weight": (hidden, inner),
            }
            if bias:
                mixer.update({"in_proj.bias": (2 * inner + 2 * s["xb"],), "dt_in_proj.bias": (s["dt_rank"],)})
            if conv_bias:
                mixer["conv1d.bias"] = (channels,)
        else:
            channels = inner + 2 * s["qk_heads"] * s["state"]
            mixer = {
                "in_proj.weight": (channels + inner + s["v_heads"], hidden),
                "conv1d.weight": (channels, 1, s["kernel"]),
                "D": (s["v_heads"],),
                "out_proj.weight": (hidden, inner),
            }
            mixer.update({"in_proj.bias": (channels + inner + s["v_heads"],)} if bias else {"z_bias": (inner,)})
            if conv_bias:
                mixer["conv1d.bias"] = (channels,)
        if code != "t" and bias:
            mixer["out_proj.bias"] = (hidden,)
        shapes.update({f"{layer}.mixer.{name}": shape for name, shape in mixer.items()})
    return shapes


def apriel_tensors(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors of about 0.15 (norm weights about 1)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in sorted(apriel_shapes(config).items()):
        noise = torch.randn(shape, generator=generator) * 0.15
        tensors[name] = 1 + noise if "norm" in name else noise
    return tensors


def save_apriel(case: str, directory: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """An Apriel checkpoint directory (config.json, model.safetensors); returns its tensors."""
    config = APRIEL_CASES[case]
    tensors = apriel_tensors(config, seed)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return tensors
