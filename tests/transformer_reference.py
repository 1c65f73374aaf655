"""Tiny transformer run configs shared by the cross-distribution tests, and an independent float64 reference of
the whole language model written from the definitions (embeddings, RMS norm, GQA attention with rotate-half
rotary embeddings and a sliding window, gated SiLU MLP, tied or untied head), reading only the model's weights;
greedy decoding without a cache.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from blockzoo.config import structure
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.runtime import Distributed
from blockzoo.model.language_model import LanguageModel
from blockzoo.run_config import RunConfig

SEED = 1234
VOCAB = 64
HIDDEN = 32
# Norm weights and biases start at ones and zeros by default: random values make them matter in the comparisons.
RANDOM_NORM = {"type": "rms_norm", "weight": {"initialization": {"type": "normal", "mean": 1.0, "std": 0.3}}}


def attention(theta: float = 10000.0, window: int | None = None, heads: int = 4, head_groups: int = 2) -> dict:
    return {
        "type": "attention",
        "heads": heads,
        "head_groups": head_groups,
        "head_size": 8,
        "rotary": {"type": "default", "theta": theta},
        "window_size": window,
    }


def block(mixer: dict) -> dict:
    return {
        "mixer": mixer,
        "mlp": {"type": "mlp", "intermediate_size": 48, "gated": True},
        "normalization": RANDOM_NORM,
    }


def model_data(*, tied: bool = True, decoder: dict | None = None) -> dict:
    return {
        "hidden_size": HIDDEN,
        "tied_embedding_weight": tied,
        "embeddings": {"vocab_size": VOCAB},
        "decoder": decoder or {"type": "fixed", "num_blocks": 2, "block": block(attention())},
        "head": {"normalization": RANDOM_NORM},
    }


# Two attention blocks that differ only in their rotary theta and window: their precomputed tables must not collide.
PATTERN_DECODER = {
    "type": "pattern",
    "pattern": ["local", "global"],
    "num_blocks": 3,
    "blocks": {"local": block(attention(theta=50.0, window=3)), "global": block(attention(theta=10000.0))},
}
MODELS = {
    "gqa-tied": model_data(tied=True),
    "gqa-untied": model_data(tied=False),
    "pattern-two-attentions": model_data(tied=False, decoder=PATTERN_DECODER),
}


def run_data(model: dict, **sections: dict) -> dict:
    return {"model": copy.deepcopy(model), "distributed": {"seed": SEED, "backend": "gloo"}, **sections}


def single_process(config: DistributedConfig | None = None) -> Distributed:
    """This process alone, on the CPU (gloo) even where CUDA is present: the references are CPU computations."""
    return Distributed(config or DistributedConfig(seed=SEED, backend="gloo"), world_size=1, rank=0, local_rank=0)


def build(model: dict) -> LanguageModel:
    run_config = structure(run_data(model), RunConfig)
    return LanguageModel(run_config.model, single_process(run_config.distributed))


# ---------------------------------------------------------------------------------------------------------------------
# The float64 reference


def _rms_norm(hidden: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    return hidden / torch.sqrt(hidden.pow(2).mean(-1, keepdim=True) + epsilon) * weight.double()


def _rotate(heads: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate pairs (i, i + head_size/2) of each head by position · theta^(-2i/head_size)."""
    half = heads.shape[-1] // 2
    angles = positions[:, None].double() * theta ** (-2 * torch.arange(half, dtype=torch.float64) / (2 * half))
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    first, second = heads[..., :half], heads[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def _attention(mixer, config, hidden: torch.Tensor, theta: float, window: int | None) -> torch.Tensor:
    """Causal attention of one document `[tokens, hidden]`, one query at a time (no biases, no per-head norms)."""
    heads, groups, head_size = config.heads, config.resolved_head_groups, config.head_size
    tokens = len(hidden)
    positions = torch.arange(tokens)
    query = (hidden @ mixer.query.weight.double().T).view(tokens, heads, head_size)
    key, value = (hidden @ mixer.key_value.weight.double().T).view(tokens, 2, groups, head_size).unbind(1)
    query, key = _rotate(query, positions, theta), _rotate(key, positions, theta)
    output = torch.zeros(tokens, heads, head_size, dtype=torch.float64)
    window = window or tokens
    for token in range(tokens):
        first = max(0, token - window + 1)
        for head in range(heads):
            group = head // (heads // groups)  # group-major layout of the query heads
            scores = key[first : token + 1, group] @ query[token, head] * head_size**-0.5
            output[token, head] = torch.softmax(scores, 0) @ value[first : token + 1, group]
    return output.flatten(1) @ mixer.dense.weight.double().T


def reference_logits(
    model: LanguageModel,
    document: torch.Tensor,
    thetas: list[float] | None = None,
    windows: list[int | None] | None = None,
) -> torch.Tensor:
    """float64 logits `[tokens, vocab]` of one document. `thetas` and `windows` replace each block's rotary theta and
    window (to show that another block's tables or mask would change the result)."""
    blocks = [config for _, config in model.config.decoder.expanded_blocks()]
    hidden = model.embeddings.word_embeddings.double()[document]
    for index, (layer, config) in enumerate(zip(model.decoder, blocks, strict=True)):
        epsilon = config.normalization.epsilon
        theta = config.mixer.rotary.theta if thetas is None else thetas[index]
        window = config.mixer.window_size if windows is None else windows[index]
        normalized = _rms_norm(hidden, layer.norm_1.weight, epsilon)
        hidden = hidden + _attention(layer.mixer, config.mixer, normalized, theta, window)
        gate, up = (_rms_norm(hidden, layer.norm_2.weight, epsilon) @ layer.mlp.gate_up.weight.double().T).chunk(2, -1)
        hidden = hidden + (F.silu(gate) * up) @ layer.mlp.down.weight.double().T
    hidden = _rms_norm(hidden, model.head.normalization.weight, model.config.head.normalization.epsilon)
    return hidden @ model.head.output_weight.double().T


def greedy_by_full_forward(
    model: LanguageModel, prompt: list[int], steps: int, stop_tokens: tuple[int, ...] = ()
) -> list[int]:
    """Greedy continuation without any cache: argmax of the full forward over the growing sequence, to the first of
    `stop_tokens`."""
    sequence = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            sequence.append(int(model(torch.tensor([sequence]))[0, -1].argmax()))
            if sequence[-1] in stop_tokens:
                break
    return sequence[len(prompt) :]
