"""An independent float64 reference of the MLA mixer, written from DeepSeek-V2's definition, for the tests.

Nothing here comes from the package except the config classes and the layer's parameters: rotary angles, norms,
the per-head keys and the attention are computed again, one query token and one head at a time.
"""

from __future__ import annotations

import torch

from blockzoo import config as configs
from blockzoo.api import Distributed
from blockzoo_attention.config import DefaultRotaryConfig, NoRotaryConfig
from blockzoo_mla.config import MLAConfig
from blockzoo_mla.mla import MultiHeadLatentAttention
from blockzoo_testing import build_layer, single_process

SEED = 2025
HIDDEN = 16
# Small but every size distinct: nope 6, rotary 4 (query/key heads of 10), values of 5, latent 8, query rank 12.
SMALL = {"heads": 4, "key_value_rank": 8, "nope_head_size": 6, "rotary_head_size": 4, "value_head_size": 5}
RANDOM_NORM = {"weight": {"initialization": {"type": "normal", "mean": 1.0, "std": 0.3}}}
RANDOM_BIAS = {"bias": {"initialization": {"type": "normal", "std": 0.5}}}


def mla_config(data: dict) -> MLAConfig:
    return configs.structure({"type": "mla", **data}, MLAConfig)


def build(data: dict, distributed: Distributed | None = None, hidden: int = HIDDEN) -> MultiHeadLatentAttention:
    return build_layer(mla_config(data), hidden, distributed or single_process(SEED))


def _rotate(vector: torch.Tensor, position: int, config, interleaved: bool) -> torch.Tensor:
    """Pair (i, i + size/2), or (2i, 2i + 1) `interleaved`, as a complex number times e^(i·position·theta^(-2i/size))
    (returned as the real parts, then the imaginary ones: the same layout for queries and keys)."""
    if isinstance(config, NoRotaryConfig):
        return vector
    assert type(config) is DefaultRotaryConfig, config
    size = len(vector)
    half = size // 2
    frequencies = 1.0 / config.theta ** (torch.arange(0, size, 2, dtype=torch.float64) / size)
    first, second = (vector[0::2], vector[1::2]) if interleaved else (vector[:half], vector[half:])
    pairs = torch.complex(first, second) * torch.polar(torch.ones(half, dtype=torch.float64), position * frequencies)
    return torch.cat([pairs.real, pairs.imag])


def _rms_norm(vector: torch.Tensor, norm, epsilon: float) -> torch.Tensor:
    return vector / torch.sqrt((vector**2).mean() + epsilon) * norm.weight.detach().double()


def _affine(linear, x: torch.Tensor) -> torch.Tensor:
    out = x @ linear.weight.detach().double().T
    return out if linear.bias is None else out + linear.bias.detach().double()


def reference_forward(layer: MultiHeadLatentAttention, hidden: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """The layer's output from its (global, single-process) parameters, causal within each document, float64."""
    config: MLAConfig = layer.config
    heads, nope, rotary, value_size = (
        config.heads,
        config.nope_head_size,
        config.rotary_head_size,
        config.value_head_size,
    )
    x = hidden.double()
    documents = [index for index, length in enumerate(lengths) for _ in range(length)]
    positions = [position for length in lengths for position in range(length)]
    queries, keys, values = [], [], []
    for token in range(len(x)):
        if config.query_rank is None:
            query = _affine(layer.query, x[token])
        else:
            compressed = _rms_norm(_affine(layer.query_down, x[token]), layer.query_norm, config.query_norm.epsilon)
            query = _affine(layer.query_up, compressed)
        latent_and_key = _affine(layer.key_value_down, x[token])
        latent = _rms_norm(latent_and_key[: config.key_value_rank], layer.key_value_norm, config.key_value_norm.epsilon)
        shared_key = _rotate(
            latent_and_key[config.key_value_rank :], positions[token], config.rotary, config.interleaved_rotary
        )
        expanded = _affine(layer.key_value_up, latent)
        token_queries, token_keys, token_values = [], [], []
        for head in range(heads):
            q = query[head * (nope + rotary) : (head + 1) * (nope + rotary)]
            token_queries.append(
                torch.cat([q[:nope], _rotate(q[nope:], positions[token], config.rotary, config.interleaved_rotary)])
            )
            kv = expanded[head * (nope + value_size) : (head + 1) * (nope + value_size)]
            token_keys.append(torch.cat([kv[:nope], shared_key]))
            token_values.append(kv[nope:])
        queries.append(token_queries)
        keys.append(token_keys)
        values.append(token_values)
    output = torch.zeros(len(x), heads * value_size, dtype=torch.float64)
    for token in range(len(x)):
        visible = [
            other
            for other in range(len(x))
            if documents[other] == documents[token] and positions[other] <= positions[token]
        ]
        for head in range(heads):
            logits = torch.stack([queries[token][head] @ keys[other][head] for other in visible])
            probabilities = torch.softmax(logits * config.resolved_softmax_scale, dim=0)
            attended = sum(p * values[other][head] for p, other in zip(probabilities, visible))
            output[token, head * value_size : (head + 1) * value_size] = attended
    return _affine(layer.dense, output)
