"""An independent float64 reference of the attention mixer, written from the definitions, for the tests.

Nothing here comes from the package except the config classes: rotary frequencies, rotations, norms
and attention are computed again, with loops where the package vectorizes.
"""

from __future__ import annotations

import math

import torch

from blockzoo import config as configs
from blockzoo.api import Distributed
from blockzoo.layers.config import LayerNormalizationConfig, RMSNormalizationConfig
from blockzoo_attention.attention import Attention
from blockzoo_attention.config import (
    AttentionConfig,
    DefaultRotaryConfig,
    Llama3RotaryConfig,
    NoRotaryConfig,
    YarnRotaryConfig,
)
from blockzoo_testing import build_layer, single_process

SEED = 2024
HIDDEN = 16


def attention_config(data: dict) -> AttentionConfig:
    return configs.structure(data, AttentionConfig)


def build(data: dict, distributed: Distributed | None = None, hidden: int = HIDDEN) -> Attention:
    """The mixer of `data` on `distributed` (default: one CPU process seeded with SEED, the reference)."""
    return build_layer(attention_config(data), hidden, distributed or single_process(SEED))


# ---------------------------------------------------------------------------------------------------------------------
# Rotary frequencies, from the papers' / Hugging Face's definitions


def rotary_frequencies(config, head_size: int) -> tuple[torch.Tensor, float]:
    """(inverse frequency of each pair, attention factor), float64."""
    base = 1.0 / config.theta ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size)
    if type(config) is DefaultRotaryConfig:
        return base, 1.0
    if type(config) is Llama3RotaryConfig:
        low_wavelength = config.original_context_length / config.low_frequency_factor
        high_wavelength = config.original_context_length / config.high_frequency_factor
        result = []
        for frequency in base.tolist():
            wavelength = 2 * math.pi / frequency
            if wavelength < high_wavelength:
                result.append(frequency)
            elif wavelength > low_wavelength:
                result.append(frequency / config.scale_factor)
            else:
                smooth = (config.original_context_length / wavelength - config.low_frequency_factor) / (
                    config.high_frequency_factor - config.low_frequency_factor
                )
                result.append((1 - smooth) * frequency / config.scale_factor + smooth * frequency)
        return torch.tensor(result, dtype=torch.float64), 1.0
    if type(config) is YarnRotaryConfig:

        def correction_dim(rotations: float) -> float:
            return (head_size * math.log(config.original_context_length / (rotations * 2 * math.pi))) / (
                2 * math.log(config.theta)
            )

        low = max(math.floor(correction_dim(config.beta_fast)), 0)
        high = min(math.ceil(correction_dim(config.beta_slow)), head_size - 1)
        if low == high:
            high += 0.001
        result = []
        for index, frequency in enumerate(base.tolist()):
            ramp = min(max((index - low) / (high - low), 0.0), 1.0)
            result.append(frequency / config.scale_factor * ramp + frequency * (1 - ramp))
        factor = config.attention_factor
        if factor is None:
            factor = 0.1 * math.log(config.scale_factor) + 1 if config.scale_factor > 1 else 1.0
        return torch.tensor(result, dtype=torch.float64), factor
    raise AssertionError(f"no reference for {config}")


def rotate(vector: torch.Tensor, position: int, config, head_size: int) -> torch.Tensor:
    """Rotate one head vector: pair (i, i + head_size/2) as a complex number times factor · e^(i·position·freq_i)."""
    if isinstance(config, NoRotaryConfig):
        return vector
    frequencies, factor = rotary_frequencies(config, head_size)
    half = head_size // 2
    pairs = torch.complex(vector[:half], vector[half:]) * torch.polar(
        torch.full((half,), factor, dtype=torch.float64), position * frequencies
    )
    return torch.cat([pairs.real, pairs.imag])


def normalize(vector: torch.Tensor, norm_config, norm) -> torch.Tensor:
    if norm_config is None:
        return vector
    weight = norm.weight.detach().double()
    if isinstance(norm_config, LayerNormalizationConfig):
        centered = vector - vector.mean()
        return centered / torch.sqrt((centered**2).mean() + norm_config.epsilon) * weight + norm.bias.detach().double()
    assert isinstance(norm_config, RMSNormalizationConfig)
    return vector / torch.sqrt((vector**2).mean() + norm_config.epsilon) * weight


def reference_forward(layer: Attention, hidden: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """The layer's output from its (global, single-process) parameters, one query token at a time, in float64."""
    config: AttentionConfig = layer.config
    heads, groups, size = config.heads, config.resolved_head_groups, config.head_size

    def affine(linear, x):
        out = x @ linear.weight.detach().double().T
        return out if linear.bias is None else out + linear.bias.detach().double()

    x = hidden.double()
    query = affine(layer.query, x).view(len(x), heads, size)
    key_value = affine(layer.key_value, x)
    key = key_value[:, : groups * size].reshape(len(x), groups, size) * config.key_multiplier
    value = key_value[:, groups * size :].reshape(len(x), groups, size)
    documents = [index for index, length in enumerate(lengths) for _ in range(length)]
    positions = [position for length in lengths for position in range(length)]
    for token in range(len(x)):
        for head in range(heads):
            query[token, head] = rotate(
                normalize(query[token, head], config.query_norm, layer.query_norm),
                positions[token],
                config.rotary,
                size,
            )
        for group in range(groups):
            key[token, group] = rotate(
                normalize(key[token, group], config.key_norm, layer.key_norm), positions[token], config.rotary, size
            )

    output = torch.zeros(len(x), heads, size, dtype=torch.float64)
    for token in range(len(x)):
        visible = [
            other
            for other in range(len(x))
            if documents[other] == documents[token]
            and (not config.causal or positions[other] <= positions[token])
            and (config.window_size is None or positions[token] - positions[other] < config.window_size)
        ]
        for head in range(heads):
            group = head // (heads // groups)
            logits = torch.stack([query[token, head] @ key[other, group] for other in visible])
            probabilities = torch.softmax(logits * config.resolved_softmax_scale, dim=0)
            output[token, head] = sum(p * value[other, group] for p, other in zip(probabilities, visible))
    output = output.view(len(x), heads * size)
    if layer.output_gate is not None:  # Qwen3-Next's gated attention
        output = output * torch.sigmoid(affine(layer.output_gate, x))
    return affine(layer.dense, output)
