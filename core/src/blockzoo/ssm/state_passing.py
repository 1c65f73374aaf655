"""What crosses the boundary between two slices of a sequence in a Mamba mixer, over a sequence-data group.

Under sequence-data parallelism the consecutive slices of a micro-batch run at the same time, one per rank of the
group, in rank order (`blockzoo.layers.base.SequenceData`). Two things of a slice depend on the slices before it:

- the causal convolution reads the kernel_size - 1 inputs before the slice (`convolution_halo`): every rank's last
  inputs are all-gathered, and each rank takes the kernel_size - 1 rows just before its first token (from the
  ranks before it, then from `previous`, the carry of the slice before the whole group);
- the SSM state (`initial_state_over_ranks`): each rank scans its slice from a zero state, which gives the state
  S_r after its last token; the slice maps the state entering it to h ↦ a_r·h + S_r, where a_r is the slice's
  total decay when the whole slice continues one document begun before it, and 0 when a document starts in it
  (the state is cut there). The (S_r, a_r) pairs are all-gathered; each rank composes the maps of the ranks before
  it, applied to `previous`'s state (an exclusive scan over ranks: its true initial state), and every rank
  composes all of them (the carry after the group's last slice, the same on every rank).

Both exchanges are all-gathers whose backward is a reduce-scatter (`blockzoo.distributed.sequence.gather_slices`): the
gradient of each rank's initial state and halo is sent back, summed, to the ranks whose states and inputs made
them. Every rank must take part in each backward collective, so the halo and the initial state always depend on
what was gathered, even where they use none of it (the first rank; `depend_on`, with a zero gradient), and a rank
whose slice does not continue a document keeps them in its graph the same way.

`initial_state_over_ranks` and `depend_on` are public (`blockzoo.api`): any linear recurrence's `forward_slice` uses
them (docs/plugins/write-a-mixer.md).
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


def convolution_halo(
    x: torch.Tensor, stored: int, batch: Batch, previous: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(halo, carry) of a causal convolution over a slice whose inputs are `x` [tokens, channels].

    halo [stored, channels]: the `stored` (kernel_size - 1) inputs just before the slice's first token, zero where
    they are not of its first piece's document; None when the slice starts a document and has no group (nothing to
    read). carry [stored, channels]: the last `stored` inputs before the next slice (after the group's last slice
    under sequence-data parallelism), whatever their document: the next slice keeps those of its own. `previous`:
    the carry of the slice before (before the group's first slice), None at the start of the sequence.
    """
    if stored == 0:  # a one-tap filter reads nothing before its token
        return None, x.new_zeros(0, x.shape[1])
    before = x.new_zeros(stored, x.shape[1]) if previous is None else previous.to(x.dtype)
    group = group_of(batch)
    tail = x[max(len(x) - stored, 0) :]  # the last min(tokens, stored) inputs
    if group is None:
        halo = before if batch.continued else None
        return _in_document(halo, batch), torch.cat([before, tail])[-stored:]
    # The ranks' slices have equal lengths: each sends its tail, so that the rows before any rank's first token are
    # the last `stored` rows of everything sent before it (whole slices when they are shorter than the window).
    tails = gather_slices(tail, group)
    sent = len(tails) // group.size()
    halo = torch.cat([before, tails[: batch.sequence_data.rank * sent]])[-stored:]
    # The first rank reads none of `tails` (and the carry may go unused): the halo keeps them in its graph.
    return _in_document(depend_on(halo, tails), batch), torch.cat([before, tails])[-stored:]


def _in_document(halo: torch.Tensor | None, batch: Batch) -> torch.Tensor | None:
    """The halo with its rows before the first piece's document zeroed (that document has `continued` tokens
    before the slice). torch.where, not a product: the zeroed rows stay in the graph with a zero gradient."""
    if halo is None or batch.continued >= len(halo):
        return halo
    keep = torch.arange(len(halo), device=halo.device) >= len(halo) - batch.continued
    return torch.where(keep[:, None], halo, 0)


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
