"""Tiny transformers models of every format, built on the CPU, every field the converter maps away from its default
(defaults hide conversion bugs), with weights large enough that the logits are far from uniform."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
import transformers

transformers.utils.logging.disable_progress_bar()

# Batch 2, a length no window or chunk divides.
TOKENS = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(1))

_ATTENTION = {
    "vocab_size": 128,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # GQA
    "intermediate_size": 96,
    "rms_norm_eps": 1e-5,
    "num_hidden_layers": 2,
}

# case -> (format, transformers config class name, config). The format's defaults are in the comments.
CASES = {
    "llama_llama3": (
        "llama",
        "LlamaConfig",
        {
            **_ATTENTION,
            "head_dim": 24,  # != hidden / heads
            "hidden_act": "gelu",
            "attention_bias": True,
            "mlp_bias": True,
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 5000.0,
                "factor": 4.0,
                "low_freq_factor": 2.0,
                "high_freq_factor": 6.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "llama_yarn": (
        "llama",
        "LlamaConfig",
        {
            **_ATTENTION,
            "num_key_value_heads": 1,  # MQA
            "hidden_act": "relu2",
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 2000.0,
                "factor": 3.0,
                "attention_factor": 1.25,
                "beta_fast": 16.0,
                "beta_slow": 2.0,
                "original_max_position_embeddings": 48,
            },
        },
    ),
    "mistral": (
        "mistral",
        "MistralConfig",
        {
            **_ATTENTION,
            "head_dim": 8,
            "sliding_window": 5,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 20000.0},
        },
    ),
    "qwen2": (
        "qwen2",
        "Qwen2Config",
        {
            **_ATTENTION,
            "num_hidden_layers": 3,
            "use_sliding_window": True,
            "sliding_window": 6,
            "max_window_layers": 1,  # layers 1 and 2 slide
            "rope_parameters": {"rope_type": "default", "rope_theta": 3000.0},
        },
    ),
    "qwen3": (
        "qwen3",
        "Qwen3Config",
        {
            **_ATTENTION,
            "num_hidden_layers": 3,
            "head_dim": 12,  # != 128, the format's default, and != hidden / heads
            "attention_bias": True,
            "use_sliding_window": True,
            "sliding_window": 5,
            "max_window_layers": 2,  # layer 2 slides
            "hidden_act": "gelu",
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 6000.0},
        },
    ),
    "mixtral": (
        "mixtral",
        "MixtralConfig",
        {
            **_ATTENTION,
            "num_local_experts": 4,
            "num_experts_per_tok": 3,
            "router_aux_loss_coef": 0.02,
            "router_jitter_noise": 0.1,
            "sliding_window": 7,
            "hidden_act": "gelu",
            "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
        },
    ),
    "qwen2_moe": (
        "qwen2_moe",
        "Qwen2MoeConfig",
        {
            **_ATTENTION,
            "num_hidden_layers": 3,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,  # two shared experts
            "norm_topk_prob": True,
            "mlp_only_layers": [1],  # a dense layer
            "qkv_bias": False,
            "use_sliding_window": True,
            "sliding_window": 6,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "router_aux_loss_coef": 0.03,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 7000.0},
        },
    ),
    "qwen3_moe": (
        "qwen3_moe",
        "Qwen3MoeConfig",
        {
            **_ATTENTION,
            "num_hidden_layers": 3,
            "head_dim": 8,
            "attention_bias": True,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "decoder_sparse_step": 2,  # the MoE on layer 1 only
            "use_sliding_window": True,
            "sliding_window": 6,
            "hidden_act": "gelu",
            "rope_parameters": {"rope_type": "default", "rope_theta": 9000.0},
        },
    ),
}


# A shared MLP of its own width, no multiple of the routed experts' 32 (transformers accepts any width).
CASES["qwen2_moe-shared-width"] = (
    *CASES["qwen2_moe"][:2],
    {**CASES["qwen2_moe"][2], "shared_expert_intermediate_size": 40},
)


def format_of(case: str) -> str:
    return CASES[case][0]


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights of about 0.15 (norm weights about 1): logits far from uniform, routers with clear choices."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator) * 0.15
            parameter.copy_(1 + noise if "norm" in name else noise)
        for name, buffer in model.named_buffers():  # a checkpoint's, zero when built (DeepSeek-V3's router)
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.05)


def transformers_model(class_name: str, config: dict, seed: int = 0) -> transformers.PreTrainedModel:
    """A randomized transformers model of this config class, with eager attention, in evaluation mode."""
    hf_config = getattr(transformers, class_name)(**config)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
    randomize(model, seed)
    return model.eval()


def hf_model(case: str, seed: int = 0) -> transformers.PreTrainedModel:
    _, class_name, config = CASES[case]
    return transformers_model(class_name, config, seed)


def save_hf_model(case: str, directory: Path, seed: int = 0) -> transformers.PreTrainedModel:
    model = hf_model(case, seed)
    model.save_pretrained(directory)
    return model


def hf_logits(model: transformers.PreTrainedModel) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def load_hf(directory: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()


def our_logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(TOKENS)
