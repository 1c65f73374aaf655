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

The rank-combining step of the state (`initial_state_over_ranks`, `depend_on`, `group_of`) is the core's, public in
`blockzoo.api` (any linear recurrence's `forward_slice` uses it): `blockzoo.distributed.recurrence`, importable
from here too. This module adds the convolution's halo.
"""

from __future__ import annotations

import torch

from blockzoo.distributed.recurrence import depend_on, group_of, initial_state_over_ranks
from blockzoo.distributed.sequence import gather_slices
from blockzoo.layers.base import Batch

__all__ = ["convolution_halo", "depend_on", "group_of", "initial_state_over_ranks"]


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
