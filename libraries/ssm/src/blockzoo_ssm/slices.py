"""The Mamba numerics over one slice of longer sequences: what a mixer's `forward_slice` is made of.

A slice (`blockzoo.layers.base.Batch` with `sequence_data`) holds pieces of documents; only its first piece may
continue a document begun before it (`batch.continued` tokens earlier). Each function returns the slice's output
and what the next slice needs (`SSMCarry`'s parts), differentiable both ways:

- one slice after another (micro-sequences; no group): the convolution reads `previous`'s last inputs and the scan
  starts from `previous`'s state, when the first piece continues a document;
- sequence-data parallelism (a group, `blockzoo_ssm.state_passing`): the convolution gets its halo from the ranks
  before; each rank scans its slice from a zero state, the ranks combine their final states and decays, and each
  rank corrects the outputs of its first piece with its true initial state h0 (the scans are linear in the state):
  y_t += C_t · exp(Σ_{k<=t} dt_k·A) · h0 for SSD (per head), and for Mamba 1's selective scan the scan of a zero
  input from h0 (its decay differs per channel and state entry, which a closed form would materialize per token).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from blockzoo.api import depend_on, initial_state_over_ranks  # the public rank-combining step
from blockzoo.layers.base import Batch
from blockzoo_ssm.conv import causal_conv1d
from blockzoo_ssm.scan import selective_scan, ssd_scan, time_step
from blockzoo_ssm.state_passing import convolution_halo, group_of


class SSMCarry(NamedTuple):
    """What a Mamba mixer's slice hands the next (its `forward_slice` carry): `convolution` [kernel_size - 1,
    channels], the last inputs of the convolution before the next slice (of any document: the next slice keeps
    those of its own), and `state`, the SSM state after the slice's last token (fp32)."""

    convolution: torch.Tensor
    state: torch.Tensor


def causal_conv1d_slice(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    batch: Batch,
    previous: torch.Tensor | None,
    *,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv1d` over a slice: (y, carry). `previous`: the carry ([kernel_size - 1, channels]) of the slice
    before (before the group's first slice under sequence-data parallelism), None at the start of the sequence."""
    halo, carry = convolution_halo(x, weight.shape[1] - 1, batch, previous)
    if halo is not None and not batch.continued:  # a group's slice that starts a document reads nothing before it
        return depend_on(causal_conv1d(x, weight, bias, batch, activation=activation), halo), carry
    return causal_conv1d(x, weight, bias, batch, activation=activation, initial=halo), carry


def ssd_scan_slice(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    batch: Batch,
    previous: torch.Tensor | None,
    *,
    chunk_size: int,
    D: torch.Tensor | None = None,
    scale_input: bool = True,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ssd_scan` over a slice: (y, the state after it [heads, head_size, state_size]). `previous`: the state
    before the slice (before the group's first slice), None at the start of the sequence."""
    options = {"chunk_size": chunk_size, "D": D, "scale_input": scale_input}
    options.update(dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
    if group_of(batch) is None:
        initial = previous if batch.continued else None
        return ssd_scan(x, dt, A, B, C, batch, initial_state=initial, return_final_state=True, **options)
    y, final = ssd_scan(x, dt, A, B, C, batch, return_final_state=True, **options)
    log_decay = time_step(dt, dt_bias, dt_softplus, dt_limit) * A.to(torch.promote_types(dt.dtype, torch.float32))
    last_decay = _last_piece(log_decay, batch).sum(0).exp()[:, None, None]  # [heads, 1, 1]
    initial, carry = initial_state_over_ranks(final, last_decay, batch, previous)
    if not batch.continued:
        return depend_on(y, initial), carry
    # From the initial state, within the first piece: y_t += exp(Σ_{k<=t} log_decay_k) · (C_t · h0), per head.
    first = batch.document_index == 0
    from_start = torch.where(first[:, None], log_decay, 0).cumsum(0).exp()  # [tokens, heads]
    groups = B.shape[1]
    per_group = initial.to(from_start.dtype).unflatten(0, (groups, -1))  # [groups, heads per group, head_size, state]
    read = torch.einsum("tgn,grpn->tgrp", C.to(from_start.dtype), per_group).flatten(1, 2)  # [tokens, heads, size]
    correction = torch.where(first[:, None, None], from_start[..., None] * read, 0)
    return (y.to(correction.dtype) + correction).to(y.dtype), carry


def selective_scan_slice(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    batch: Batch,
    previous: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`selective_scan` over a slice: (y, the state after it [channels, state_size]). `previous`: the state before
    the slice (before the group's first slice), None at the start of the sequence."""
    if group_of(batch) is None:
        initial = previous if batch.continued else None
        return selective_scan(u, delta, A, B, C, batch, initial_state=initial, return_final_state=True)
    y, final = selective_scan(u, delta, A, B, C, batch, return_final_state=True)
    dtype = torch.promote_types(delta.dtype, torch.float32)
    last_decay = torch.exp(_last_piece(delta.to(dtype), batch).sum(0)[:, None] * A.to(dtype))  # [channels, state]
    initial, carry = initial_state_over_ranks(final, last_decay, batch, previous)
    if not batch.continued:
        return depend_on(y, initial), carry
    # The scan is linear in its state: what the initial state adds is the scan of a zero input from it (zero beyond
    # the first piece: the other pieces start from a zero state).
    correction = selective_scan(torch.zeros_like(u), delta, A, B, C, batch, initial_state=initial)
    dtype = torch.promote_types(y.dtype, torch.float32)
    return (y.to(dtype) + correction.to(dtype)).to(y.dtype), carry


def _last_piece(values: torch.Tensor, batch: Batch) -> torch.Tensor:
    """[tokens, ...] values, zero outside the slice's last piece."""
    last = batch.document_index == batch.num_documents - 1
    return torch.where(last.view(-1, *[1] * (values.ndim - 1)), values, 0)
