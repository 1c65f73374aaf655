"""Rotary position embeddings, rotate-half layout (Llama's): dims i and i + head_size/2 of a head form a pair.

Each rotary type has a frequency function `fn(config, head_size) -> (inverse_frequencies, attention_factor)`
registered as its implementation: `inverse_frequencies` (float64, head_size/2 values) gives each pair's
angle per position, `attention_factor` scales the cos/sin tables (YaRN). A mixer keeps them as constants
(`Rotary`); the tables for a batch are computed once per distinct `Rotary` through `Batch.preprocessed`.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from blockzoo.api import Batch, get_registry
from blockzoo_attention.config import (
    DefaultRotaryConfig,
    Llama3RotaryConfig,
    PartialRotaryConfig,
    RotaryConfig,
    YarnRotaryConfig,
)


def _base_frequencies(theta: float, head_size: int) -> torch.Tensor:
    return theta ** -(torch.arange(0, head_size, 2, dtype=torch.float64) / head_size)


def default_frequencies(config: DefaultRotaryConfig, head_size: int) -> tuple[torch.Tensor, float]:
    return _base_frequencies(config.theta, head_size), 1.0


def llama3_frequencies(config: Llama3RotaryConfig, head_size: int) -> tuple[torch.Tensor, float]:
    frequencies = _base_frequencies(config.theta, head_size)
    wavelengths = 2 * math.pi / frequencies
    # Wavelengths in units of the original context: long ones are scaled, short ones kept, a linear blend between.
    blend = (config.original_context_length / wavelengths - config.low_frequency_factor) / (
        config.high_frequency_factor - config.low_frequency_factor
    )
    blend = blend.clamp(0, 1)
    return (1 - blend) * frequencies / config.scale_factor + blend * frequencies, 1.0


def yarn_frequencies(config: YarnRotaryConfig, head_size: int) -> tuple[torch.Tensor, float]:
    frequencies = _base_frequencies(config.theta, head_size)

    def pair_with_rotations(rotations: float) -> float:
        # The (fractional) pair index whose angle turns `rotations` times over the original context.
        return (
            head_size
            * math.log(config.original_context_length / (rotations * 2 * math.pi))
            / (2 * math.log(config.theta))
        )

    low = max(math.floor(pair_with_rotations(config.beta_fast)), 0)
    high = min(math.ceil(pair_with_rotations(config.beta_slow)), head_size - 1)
    if low == high:
        high += 0.001  # Avoid a division by zero: a step instead of a ramp.
    # 0 where the pair turns often (kept), 1 where it turns rarely (interpolated by scale_factor).
    interpolated = ((torch.arange(head_size // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    scaled = (1 - interpolated) * frequencies + interpolated * frequencies / config.scale_factor
    return scaled, config.resolved_attention_factor


def partial_frequencies(config: PartialRotaryConfig, head_size: int) -> tuple[torch.Tensor, float]:
    # The first rotary_size/2 pairs turn as in a head of rotary_size channels; the others do not turn at all.
    rotary_size = config.rotary_size(head_size)
    turning = _base_frequencies(config.theta, rotary_size)
    return torch.cat([turning, turning.new_zeros(head_size // 2 - rotary_size // 2)]), 1.0


def frequencies(config: RotaryConfig, head_size: int) -> tuple[torch.Tensor, float] | None:
    """(inverse frequencies, attention factor) of a rotary type; None for a type without embedding (`none`)."""
    implementation = get_registry().implementation_of(config)
    return None if implementation is None else implementation(config, head_size)


class Rotary(NamedTuple):
    """A rotary embedding's constants: each pair's inverse frequency (float64 values as Python floats) and the
    attention factor. A mixer looks them up once, when it is built (`rotary_constants`), so that its forward, which
    torch.compile traces inside a compiled block, never calls the plugin registry (torch.compile cannot trace it:
    every block broke into several graphs)."""

    inverse_frequencies: tuple[float, ...]
    attention_factor: float


def rotary_constants(config: RotaryConfig, head_size: int) -> Rotary | None:
    """The `Rotary` of a rotary type for heads of `head_size`; None for a type without embedding (`none`)."""
    with torch.device("cpu"):  # values, whatever the default device (a model built on the meta device)
        found = frequencies(config, head_size)
    return None if found is None else Rotary(tuple(found[0].tolist()), float(found[1]))


# Two functions: torch.compile looks through an lru_cache and would ignore the constant mark put on it.
@functools.lru_cache(maxsize=64)
def _copied(values: tuple[float, ...], device_type: str, device_index: int | None) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, device=torch.device(device_type, device_index))


@torch.compiler.assume_constant_result
def _on_device(values: tuple[float, ...], device_type: str, device_index: int | None) -> torch.Tensor:
    """float64 `values` on the device, copied once (a copy from pageable host memory in every step would make the
    host wait for the device); a constant to torch.compile, which calls this rather than tracing the cache."""
    return _copied(values, device_type, device_index)


def rotary_tables(rotary: Rotary | None, batch: Batch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cos and sin, `[tokens, head_size]` in fp32, at the batch's positions; None without rotary embedding."""
    if rotary is None:
        return None

    def compute() -> tuple[torch.Tensor, torch.Tensor]:
        inverse_frequencies = _on_device(rotary.inverse_frequencies, batch.device.type, batch.device.index)
        # float64 angles: positions in the hundreds of thousands keep their precision.
        angles = batch.positions.to(torch.float64)[:, None] * inverse_frequencies[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        return (angles.cos() * rotary.attention_factor).float(), (angles.sin() * rotary.attention_factor).float()

    return batch.preprocessed(("blockzoo_attention.rotary", rotary), compute)


def apply_rotary(heads: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate `[tokens, heads, head_size]` by the tables (computed in fp32, returned in the input's dtype)."""
    cos, sin = (table[:, None, :] for table in tables)
    first, second = heads.float().chunk(2, dim=-1)
    rotated_half = torch.cat([-second, first], dim=-1)
    return (heads.float() * cos + rotated_half * sin).to(heads.dtype)
