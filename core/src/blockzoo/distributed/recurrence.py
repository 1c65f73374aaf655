"""The rank-combining step of a linear recurrence under sequence-data parallelism (public: `blockzoo.api`).

Under sequence-data parallelism the consecutive slices of a micro-batch run at the same time, one per rank of the
group, in rank order (`blockzoo.layers.base.SequenceData`). A linear recurrence h_t = a_t ⊙ h_{t-1} + b_t (an SSM,
a decaying sum, a gated delta rule's state) scans its slice from a zero state, which gives the state S_r after its
last token; the slice maps the state entering it to h ↦ a_r·h + S_r, where a_r is the slice's total decay when the
whole slice continues one document begun before it, and 0 when a document starts in it (the state is cut there).
`initial_state_over_ranks` all-gathers the (S_r, a_r) pairs; each rank composes the maps of the ranks before it,
applied to the carry of the step before (an exclusive scan over ranks: its true initial state), and every rank
composes all of them (the carry after the group's last slice, the same on every rank).

The exchange is an all-gather whose backward is a reduce-scatter (`blockzoo.distributed.sequence.gather_slices`):
the gradient of each rank's initial state is sent back, summed, to the ranks whose states made it. Every rank must
take part in each backward collective, so what a rank computes always depends on what was gathered, even where it
uses none of it (`depend_on`, with a zero gradient). Mixer plugins call these from their `forward_slice`
(docs/plugins/write-a-mixer.md); blockzoo-ssm's Mamba slices do (with the convolution's halo beside them).
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from blockzoo.distributed.sequence import gather_slices
from blockzoo.layers.base import Batch


def group_of(batch: Batch) -> ProcessGroup | None:
    """The sequence-data group whose ranks hold the other slices of this step; None when there is none (a slice run
    alone, one micro-sequence chunk after another, or a group of one)."""
    sequence_data = batch.sequence_data
    group = None if sequence_data is None else sequence_data.group
    return None if group is None or group.size() == 1 else group


def initial_state_over_ranks(
    final: torch.Tensor, decay: torch.Tensor, batch: Batch, previous: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(initial, carry): this rank's true initial state and the state after the group's last slice: the rank-combining
    step of a linear recurrence h_t = a_t ⊙ h_{t-1} + b_t under sequence-data parallelism (public:
    `blockzoo.api.initial_state_over_ranks`).

    Each rank scans its slice from a zero state and calls this with, on every rank of `batch.sequence_data.group`
    (a collective; tensors of the same shape everywhere): `final`, the state after its last token; `decay`
    (broadcastable to `final`), the product of the per-token decays of the slice's last piece, which carries the
    entering state through the slice when it lies inside one continued document (it is ignored, taken as 0, when a
    document starts in the slice: the state is cut there); `previous`, the state before the group's first slice
    (the carry of the step before; None: zeros). Rank r's initial state is Σ_{j<r} (Π_{j<i<r} a_i) S_j + (Π_{i<r}
    a_i) · previous; the carry the same over all ranks, identical on every rank. The rank then adds what the initial
    state contributes to its first piece (the recurrence is linear in it: the scan of zero inputs from it) when
    `batch.continued > 0`, and else keeps it in its graph with `depend_on(output, initial)`. Both results are fp32
    (float64 for float64 states) and differentiable: the backward returns each rank's share of the gradient.
    """
    group = group_of(batch)
    if group is None:
        raise ValueError("initial_state_over_ranks: the batch has no sequence-data group of several ranks")
    dtype = torch.promote_types(final.dtype, torch.float32)
    # The slice carries the entering state only if it starts inside a document and no document starts in it.
    carries_through = batch.num_documents == 1 and batch.continued > 0
    decay = decay.to(dtype) if carries_through else torch.zeros_like(decay, dtype=dtype)
    pairs = gather_slices(torch.cat([final.to(dtype).flatten(), decay.flatten()])[None], group)
    finals, decays = pairs.split([final.numel(), decay.numel()], dim=1)
    state = torch.zeros_like(final, dtype=dtype) if previous is None else previous.to(dtype)
    initial = state
    for rank in range(group.size()):
        if rank == batch.sequence_data.rank:
            initial = state
        state = decays[rank].view(decay.shape) * state + finals[rank].view(final.shape)
    # The first rank's initial state is `previous` (and the carry may go unused): it keeps the pairs in its graph.
    return depend_on(initial, pairs), state


class _DependOn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        ctx.other = (other.shape, other.dtype, other.device)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape, dtype, device = ctx.other
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def depend_on(output: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """`output`, with `other` in its graph at a zero gradient: a rank that does not use what an exchange gave it
    still joins the exchange's backward collective (the other ranks would wait for it). Public:
    `blockzoo.api.depend_on`."""
    return _DependOn.apply(output, other) if torch.is_grad_enabled() and other.requires_grad else output
