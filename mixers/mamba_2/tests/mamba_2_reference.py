"""An independent float64 reference of the Mamba 2 mixer, written from the definitions, for the tests.

Nothing here comes from the package but the config classes and the layer's parameters: the convolution, the
recurrence (one token at a time), the skip, the gated norm (each variant) and the projections are computed again
with loops.
"""

from __future__ import annotations

import math

import torch

from blockzoo import config as configs
from blockzoo.api import Distributed
from blockzoo_mamba_2.config import Mamba2Config
from blockzoo_mamba_2.mamba_2 import Mamba2
from blockzoo_testing import build_layer, single_process

SEED = 2024
HIDDEN = 16
# Parameters that start at constants (biases, D, norm weight): give them values so that they matter.
RANDOM = {"initialization": {"type": "normal", "std": 0.5}}
AROUND_ONE = {"initialization": {"type": "normal", "mean": 1.0, "std": 0.3}}


def mamba_2_config(data: dict) -> Mamba2Config:
    return configs.structure(data, Mamba2Config)


def build(data: dict, distributed: Distributed | None = None, hidden: int = HIDDEN) -> Mamba2:
    """The mixer of `data` on `distributed` (default: one CPU process seeded with SEED, the reference)."""
    return build_layer(mamba_2_config(data), hidden, distributed or single_process(SEED))


def _value(parameter: torch.Tensor | None) -> torch.Tensor | None:
    return None if parameter is None else parameter.detach().double()


def _silu(value: torch.Tensor) -> torch.Tensor:
    return value / (1 + torch.exp(-value))


def _rms_norm(config: Mamba2Config, value: torch.Tensor) -> torch.Tensor:
    """RMSNorm without weight over each group of the norm's channels (all of them unless per group)."""
    norm = config.normalization
    group_size = config.inner_size // config.groups if norm.per_group else config.inner_size
    return torch.cat([part / math.sqrt(float((part**2).mean()) + norm.epsilon) for part in value.split(group_size)])


def reference_forward(layer: Mamba2, hidden: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """The layer's output from its (global, single-process) parameters, one token at a time, in float64."""
    config: Mamba2Config = layer.config
    heads, size, groups, state_size = config.heads, config.head_size, config.groups, config.state_size
    inner, kernel_size = heads * size, config.convolution.kernel_size
    heads_per_group = heads // groups

    def affine(linear, value):
        output = value @ linear.weight.detach().double().T
        return output if linear.bias is None else output + linear.bias.detach().double()

    projected = affine(layer.in_proj, hidden.double())
    z_all, xbc_all, dt_all = projected.split([inner, inner + 2 * groups * state_size, heads], dim=-1)
    filters, filter_bias = _value(layer.convolution.weight), _value(layer.convolution.bias)
    dt_bias, a, d = _value(layer.dt_bias), -torch.exp(_value(layer.a_log)), _value(layer.d)
    norm = config.normalization
    norm_weight = _value(layer.normalization.weight) if norm.enabled else None
    low, high = config.dt_limit

    outputs = []
    start = 0
    for length in lengths:
        state = torch.zeros(heads, size, state_size, dtype=torch.float64)  # Every document starts from zero.
        for t in range(length):
            token = start + t
            # The convolution: filters[:, -1] multiplies this token, filters[:, -1 - j] the one j steps back.
            xbc = torch.zeros(xbc_all.shape[1], dtype=torch.float64) if filter_bias is None else filter_bias.clone()
            for back in range(min(kernel_size, t + 1)):
                xbc += filters[:, kernel_size - 1 - back] * xbc_all[token - back]
            xbc = _silu(xbc)
            x = xbc[:inner].view(heads, size)
            b = xbc[inner : inner + groups * state_size].view(groups, state_size)
            c = xbc[inner + groups * state_size :].view(groups, state_size)
            y = torch.zeros(heads, size, dtype=torch.float64)
            for head in range(heads):
                group = head // heads_per_group
                dt = min(max(math.log1p(math.exp(float(dt_all[token, head] + dt_bias[head]))), low), high)
                state[head] = math.exp(dt * float(a[head])) * state[head] + dt * torch.outer(x[head], b[group])
                skip = d[head * size : (head + 1) * size] if config.d_per_channel else d[head]
                y[head] = state[head] @ c[group] + skip * x[head]
            gate = _silu(z_all[token])
            if not norm.enabled:  # y · silu(z)
                output = y.flatten() * gate
            elif norm.norm_before_gate:  # RMSNorm(y) · weight · silu(z)
                output = _rms_norm(config, y.flatten()) * norm_weight * gate
            else:  # RMSNorm(y · silu(z)) · weight
                output = _rms_norm(config, y.flatten() * gate) * norm_weight
            outputs.append(affine(layer.out_proj, output))
        start += length
    return torch.stack(outputs)
