"""An independent float64 reference of the discrete Mamba 2 mixer, written from its definition, for the tests.

Nothing here comes from the package but the config and the layer's (global, single-process) parameters: the
projections, the convolution and the recurrence are computed again, one document and one token at a time.
"""

from __future__ import annotations

import torch

from blockzoo import config as configs
from blockzoo.api import Distributed
from blockzoo_discrete_mamba_2.config import DiscreteMamba2Config
from blockzoo_discrete_mamba_2.mixer import DiscreteMamba2
from blockzoo_testing import build_layer, single_process

SEED = 2024
HIDDEN = 16
SMALL = {"heads": 4, "groups": 2, "head_size": 3, "state_size": 5, "chunk_size": 4}
# Biases, z_bias and D start at zeros and ones by default: random values make them matter.
RANDOM = {"initialization": {"type": "normal", "std": 0.5}}
RANDOM_BIAS = {"bias": RANDOM}


def build(data: dict, distributed: Distributed | None = None, hidden: int = HIDDEN) -> DiscreteMamba2:
    """The mixer of `data` on `distributed` (default: one CPU process seeded with SEED, the reference)."""
    return build_layer(configs.structure(data, DiscreteMamba2Config), hidden, distributed or single_process(SEED))


def _value(parameter: torch.Tensor | None) -> torch.Tensor | None:
    return None if parameter is None else parameter.detach().double()


def _affine(linear, x: torch.Tensor) -> torch.Tensor:
    out = x @ _value(linear.weight).T
    return out if linear.bias is None else out + _value(linear.bias)


def reference_projections(layer: DiscreteMamba2, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
    """in_proj's output split into the reference's components: xbc (before the convolution), z, a_log."""
    config = layer.config
    inner, group_state = config.inner_size, config.resolved_groups * config.state_size
    xbc, z, a_log = _affine(layer.in_proj, hidden.double()).split([inner + 2 * group_state, inner, config.heads], -1)
    return {"xbc": xbc, "z": z, "a_log": a_log}


def reference_convolution(layer: DiscreteMamba2, xbc: torch.Tensor) -> torch.Tensor:
    """The causal convolution of one document, tap by tap, then the activation."""
    weight, bias = _value(layer.convolution.weight), _value(layer.convolution.bias)
    kernel = weight.shape[1]
    out = torch.zeros_like(xbc)
    for t in range(len(xbc)):
        for back in range(min(kernel, t + 1)):  # Taps before the document's first token are zero.
            out[t] += weight[:, kernel - 1 - back] * xbc[t - back]
        if bias is not None:
            out[t] += bias
    return torch.nn.functional.silu(out) if layer.config.activation == "silu" else out


def reference_forward(layer: DiscreteMamba2, hidden: torch.Tensor, lengths: list[int], *, scan=None) -> torch.Tensor:
    """The layer's output in float64, document by document. `scan(x, a_log, b, c)` -> y replaces the step-by-step
    recurrence (an external oracle); x [tokens, heads, head_size], a_log [tokens, heads], b, c [tokens, groups,
    state]."""
    config = layer.config
    heads, groups, size, state = config.heads, config.resolved_groups, config.head_size, config.state_size
    outputs = []
    for document in hidden.split(lengths):
        parts = reference_projections(layer, document)
        xbc = reference_convolution(layer, parts["xbc"])
        x, b, c = xbc.split([heads * size, groups * state, groups * state], -1)
        x, b, c = x.view(-1, heads, size), b.view(-1, groups, state), c.view(-1, groups, state)
        y = (scan or recurrence)(x, parts["a_log"], b, c)
        y = y + _value(layer.d)[:, None] * x
        z = parts["z"] if layer.z_bias is None else parts["z"] + _value(layer.z_bias)
        outputs.append(_affine(layer.out_proj, y.reshape(len(document), -1) * torch.nn.functional.silu(z)))
    return torch.cat(outputs)


def recurrence(x: torch.Tensor, a_log: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """s_t = exp(-softplus(a_log_t)) · s_{t-1} + x_t ⊗ B_t, y_t = s_t · C_t from s = 0, one token and head at a
    time."""
    tokens, heads, _ = x.shape
    heads_per_group = heads // b.shape[1]
    s = torch.zeros(heads, x.shape[2], b.shape[2], dtype=torch.float64)
    y = torch.zeros_like(x)
    for t in range(tokens):
        for h in range(heads):
            g = h // heads_per_group
            decay = torch.exp(-torch.nn.functional.softplus(a_log[t, h]))
            s[h] = decay * s[h] + torch.outer(x[t, h], b[t, g])
            y[t, h] = s[h] @ c[t, g]
    return y
