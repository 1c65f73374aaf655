"""An independent float64 reference of the Mamba mixer, written from the definitions (mamba_ssm's `Mamba`, HF's
`MambaMixer`, Jamba's norms, Apriel's grouped x/B layers), for the tests.

Nothing here comes from the package but the config classes and the layer's parameters: the convolution, norms,
softplus, head repetition and the recurrence are computed again, one document, one token, one channel at a time.
"""

from __future__ import annotations

import math

import torch

from blockzoo import config as configs
from blockzoo.api import Distributed
from blockzoo.layers.config import LayerNormalizationConfig, RMSNormalizationConfig
from blockzoo_mamba.config import MambaConfig
from blockzoo_mamba.mamba import Mamba
from blockzoo_testing import build_layer, single_process

SEED = 2024
HIDDEN = 16


def mamba_config(data: dict) -> MambaConfig:
    return configs.structure(data, MambaConfig)


def build(data: dict, distributed: Distributed | None = None, hidden: int = HIDDEN) -> Mamba:
    """The mixer of `data` on `distributed` (default: one CPU process seeded with SEED, the reference)."""
    return build_layer(mamba_config(data), hidden, distributed or single_process(SEED))


def _value(parameter: torch.Tensor | None) -> torch.Tensor | None:
    return None if parameter is None else parameter.detach().double()


def _affine(linear, x: torch.Tensor) -> torch.Tensor:
    out = x @ _value(linear.weight).T
    return out if linear.bias is None else out + _value(linear.bias)


def _normalize(vector: torch.Tensor, norm_config, norm) -> torch.Tensor:
    if norm_config is None:
        return vector
    weight = _value(norm.weight)
    if isinstance(norm_config, LayerNormalizationConfig):
        centered = vector - vector.mean()
        return centered / torch.sqrt((centered**2).mean() + norm_config.epsilon) * weight + _value(norm.bias)
    assert isinstance(norm_config, RMSNormalizationConfig)
    return vector / torch.sqrt((vector**2).mean() + norm_config.epsilon) * weight


def _silu(value: torch.Tensor) -> torch.Tensor:
    return value / (1 + torch.exp(-value))


def _softplus(value: float) -> float:
    return math.log1p(math.exp(value))


def _convolve(inputs: torch.Tensor, layer: Mamba) -> torch.Tensor:
    """One document [tokens, channels]: out[t, c] = silu(Σ_j w[c, k-1-j] · in[t-j, c] + bias[c]), taps before the
    document's first token reading zero."""
    weight, bias = _value(layer.convolution.weight), _value(layer.convolution.bias)
    kernel_size = weight.shape[1]
    output = torch.zeros_like(inputs)
    for token in range(len(inputs)):
        for channel in range(inputs.shape[1]):
            total = 0.0 if bias is None else float(bias[channel])
            for back in range(kernel_size):
                if token - back >= 0:
                    total += float(weight[channel, kernel_size - 1 - back] * inputs[token - back, channel])
            output[token, channel] = total
    return _silu(output)


def reference_forward(layer: Mamba, hidden: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """The layer's output from its (global, single-process) parameters, in float64."""
    config: MambaConfig = layer.config
    state_size, hidden_size = config.state_size, hidden.shape[1]
    inner = config.resolved_inner_size(hidden_size)
    dt_rank = config.resolved_dt_rank(hidden_size)
    a = -torch.exp(_value(layer.a_log))
    d = _value(layer.d)
    dt_bias = torch.zeros(inner, dtype=torch.float64) if layer.dt_bias is None else _value(layer.dt_bias)

    outputs = []
    for document in hidden.double().split(lengths):
        projected = _affine(layer.in_proj, document)
        if config.grouped:
            xb = config.xb_size
            z, x_in, b_in, c_in = projected.split([inner, xb, xb, inner], dim=1)
            repeats = (inner // state_size) // (xb // state_size)
            # Channel i of the scan is channel i % state_size of head i // state_size, which reads x/B head
            # (i // state_size) // repeats.
            source = [((i // state_size) // repeats) * state_size + i % state_size for i in range(inner)]
            if config.repeat_xb_before_convolution:
                x = _convolve(x_in[:, source], layer)
            else:
                x = _convolve(x_in, layer)[:, source]
            dt = _affine(layer.dt_in_proj, document)
            b_heads = b_in.view(len(document), -1, state_size)
            c_heads = c_in.view(len(document), -1, state_size)
        else:
            x_in, z = projected.split([inner, inner], dim=1)
            x = _convolve(x_in, layer)
            dt, b_single, c_single = _affine(layer.x_proj, x).split([dt_rank, state_size, state_size], dim=1)
            b_heads, c_heads = b_single[:, None], c_single[:, None]
        dt = torch.stack([_normalize(row, config.dt_norm, layer.dt_norm) for row in dt])
        b_heads = torch.stack(
            [torch.stack([_normalize(v, config.b_norm, layer.b_norm) for v in row]) for row in b_heads]
        )
        c_heads = torch.stack(
            [torch.stack([_normalize(v, config.c_norm, layer.c_norm) for v in row]) for row in c_heads]
        )
        delta_raw = dt @ _value(layer.dt_proj.weight).T + dt_bias

        # The recurrence, channel by channel: s_t = exp(Δ_t·A) s_{t-1} + Δ_t·x_t·B_t, y_t = s_t·C_t + D·x_t.
        y = torch.zeros(len(document), inner, dtype=torch.float64)
        for channel in range(inner):
            head = channel // state_size
            b_group = (head // ((inner // state_size) // b_heads.shape[1])) if config.grouped else 0
            c_group = head if config.grouped else 0
            state = torch.zeros(state_size, dtype=torch.float64)
            for token in range(len(document)):
                delta = _softplus(float(delta_raw[token, channel]))
                state = torch.exp(delta * a[channel]) * state + delta * x[token, channel] * b_heads[token, b_group]
                y[token, channel] = state @ c_heads[token, c_group] + d[channel] * x[token, channel]
        outputs.append(_affine(layer.out_proj, y * _silu(z)))
    return torch.cat(outputs)
