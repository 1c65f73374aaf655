"""An independent float64 reference of the Gated DeltaNet mixer, written from the definitions, for the tests.

Nothing here comes from the package but the config classes and the layer's parameters: the projections, the
convolution, the L2 norms, the gated delta rule (one token at a time, in the brief's form S_t = α_t S_{t-1}
(I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ, o_t = S_t q_t) and the gated norm are computed again with loops.
"""

from __future__ import annotations

import torch

from blockzoo import config as configs
from blockzoo.api import Distributed
from blockzoo_gated_delta_net.config import GatedDeltaNetConfig
from blockzoo_gated_delta_net.gated_delta_net import GatedDeltaNet
from blockzoo_testing import build_layer, single_process

SEED = 2025
HIDDEN = 16
# Parameters that start at constants (biases, norm weight): give them values so that they matter.
RANDOM = {"initialization": {"type": "normal", "std": 0.5}}
AROUND_ONE = {"initialization": {"type": "normal", "mean": 1.0, "std": 0.3}}
# Decays that matter within a few tokens: softplus(a + dt_bias) around 0.1-3 and A around 0.3-3.
STRONG_DECAY = {
    "dt_bias": {"initialization": {"type": "normal", "std": 1.0}},
    "a_log": {"initialization": {"type": "normal", "std": 0.7}},
}


def gated_delta_net_config(data: dict) -> GatedDeltaNetConfig:
    return configs.structure({"type": "gated_delta_net", **data}, GatedDeltaNetConfig)


def build(data: dict, distributed: Distributed | None = None, hidden: int = HIDDEN) -> GatedDeltaNet:
    """The mixer of `data` on `distributed` (default: one CPU process seeded with SEED, the reference)."""
    return build_layer(gated_delta_net_config(data), hidden, distributed or single_process(SEED))


def _value(parameter: torch.Tensor | None) -> torch.Tensor | None:
    return None if parameter is None else parameter.detach().double()


def _silu(value: torch.Tensor) -> torch.Tensor:
    return value / (1 + torch.exp(-value))


def _softplus(value: torch.Tensor) -> torch.Tensor:
    return torch.log1p(torch.exp(value))


def delta_rule_loop(q, k, v, log_decay, beta, initial=None):
    """The gated delta rule of one document, token by token, in float64, from the definition.

    q, k: [tokens, key_heads, key_size] (normalised and scaled already); v: [tokens, value_heads, value_size];
    log_decay, beta: [tokens, value_heads]. The state of value head h is S [value_size, key_size], read by key
    head h // (value_heads / key_heads). Returns (o [tokens, value_heads, value_size], S [heads, key, value]).
    """
    tokens, value_heads, value_size = v.shape
    group = value_heads // k.shape[1]
    key_size = k.shape[-1]
    states = (
        [torch.zeros(value_size, key_size, dtype=torch.float64) for _ in range(value_heads)]
        if initial is None
        else [initial[head].double().t().clone() for head in range(value_heads)]
    )
    identity = torch.eye(key_size, dtype=torch.float64)
    output = torch.zeros(tokens, value_heads, value_size, dtype=torch.float64)
    for t in range(tokens):
        for head in range(value_heads):
            q_t, k_t, v_t = q[t, head // group], k[t, head // group], v[t, head]
            alpha, b = torch.exp(log_decay[t, head]), beta[t, head]
            states[head] = alpha * states[head] @ (identity - b * torch.outer(k_t, k_t)) + b * torch.outer(v_t, k_t)
            output[t, head] = states[head] @ q_t
    return output, torch.stack([state.t() for state in states])


def reference_forward(layer: GatedDeltaNet, hidden: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """The layer's output on packed documents of `lengths`, each document on its own, in float64."""
    config = layer.config
    key_heads, value_heads = config.key_heads, config.value_heads
    dk, dv = config.key_head_size, config.value_head_size
    weight, bias = _value(layer.in_proj.weight), _value(layer.in_proj.bias)
    projected = hidden.double() @ weight.t() + (0 if bias is None else bias)
    sizes = [key_heads * dk, key_heads * dk, value_heads * dv, value_heads * dv, value_heads, value_heads]
    conv_weight, conv_bias = _value(layer.convolution.weight), _value(layer.convolution.bias)
    kernel_size = conv_weight.shape[1]
    outputs, start = [], 0
    for length in lengths:
        rows = projected[start : start + length]
        start += length
        qkv_in = rows[:, : sum(sizes[:3])]
        z, b, a = rows[:, sum(sizes[:3]) :].split(sizes[3:], dim=-1)
        # The causal convolution: each channel's filter over the document's past inputs, zeros before its start.
        qkv = torch.zeros_like(qkv_in)
        for t in range(length):
            total = torch.zeros(qkv_in.shape[1], dtype=torch.float64) if conv_bias is None else conv_bias.clone()
            for j in range(kernel_size):
                if t - j >= 0:
                    total = total + conv_weight[:, kernel_size - 1 - j] * qkv_in[t - j]
            qkv[t] = _silu(total)
        q, k, v = qkv.split(sizes[:3], dim=-1)
        q, k = (x.view(length, key_heads, dk) for x in (q, k))
        q = q / q.square().sum(-1, keepdim=True).add(1e-6).sqrt() / dk**0.5
        k = k / k.square().sum(-1, keepdim=True).add(1e-6).sqrt()
        log_decay = -torch.exp(_value(layer.a_log)) * _softplus(a + _value(layer.dt_bias))
        o, _ = delta_rule_loop(q, k, v.view(length, value_heads, dv), log_decay, torch.sigmoid(b))
        # RMSNorm per value head, the weight shared by the heads, then the gate.
        epsilon = config.normalization.epsilon
        normalized = o / o.square().mean(-1, keepdim=True).add(epsilon).sqrt() * _value(layer.normalization.weight)
        gated = normalized * _silu(z.view(length, value_heads, dv))
        out_weight, out_bias = _value(layer.out_proj.weight), _value(layer.out_proj.bias)
        outputs.append(gated.flatten(1) @ out_weight.t() + (0 if out_bias is None else out_bias))
    return torch.cat(outputs)
