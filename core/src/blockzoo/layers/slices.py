"""Slices of a micro-batch's tokens (sequence-data parallelism, micro-sequences): which tokens a rank runs, the `Batch`
of a slice (its pieces of documents), and the losses of a micro-batch run as slices (summed over the slices and the
group's ranks)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from blockzoo.distributed.sequence import sum_over_slices
from blockzoo.layers.batch import Batch, SequenceData


def slice_lengths(lengths: Sequence[int], start: int, stop: int) -> tuple[list[int], list[int]]:
    """(piece lengths, offsets) of tokens [start, stop) of packed documents of `lengths`: the pieces of the
    documents that overlap the slice, in order, and the tokens of each piece's document before the slice."""
    total = sum(lengths)
    if not 0 <= start < stop <= total:
        raise ValueError(f"slice [{start}, {stop}) of {total} tokens: need 0 <= start < stop <= {total}")
    pieces, offsets, document_start = [], [], 0
    for length in lengths:
        document_stop = document_start + length
        if document_stop > start and document_start < stop:
            first = max(document_start, start)
            pieces.append(min(document_stop, stop) - first)
            offsets.append(first - document_start)
        document_start = document_stop
    return pieces, offsets


def slice_ranges(tokens: int, ranks: int, rank: int, length: int | None = None) -> list[tuple[int, int]]:
    """The token ranges [start, stop) that sequence-data rank `rank` of `ranks` runs, in order, of a micro-batch of
    `tokens` tokens, in chunks of `length` tokens (micro-sequences; default: the whole share, tokens / ranks).

    At step c the ranks' chunks are tokens [c·N·L, (c+1)·N·L), rank s taking [(c·N + s)·L, (c·N + s + 1)·L): the
    slices of a step are consecutive, so each step carries to the next the state after its last slice. Without
    micro-sequences rank s holds [s·T/N, (s+1)·T/N)."""
    length = length or tokens // ranks
    if length < 1 or tokens % (ranks * length):
        raise ValueError(
            f"a micro-batch of {tokens} tokens does not split into slices of {length} tokens over {ranks} "
            "sequence-data-parallel ranks"
        )
    starts = [(step * ranks + rank) * length for step in range(tokens // (ranks * length))]
    return [(start, start + length) for start in starts]


def slice_batch(
    lengths: Sequence[int] | torch.Tensor,
    start: int,
    stop: int,
    *,
    sequence_data: SequenceData | None = None,
    device: torch.device | str = "cpu",
) -> Batch:
    """The `Batch` of tokens [start, stop) of a micro-batch of packed documents of `lengths` (host integers): its
    pieces of documents, positions counted in the whole documents. `sequence_data`: the slice's group (default: a
    slice run in one process, `SequenceData()`)."""
    lengths = torch.as_tensor(lengths, dtype=torch.int64).tolist()
    pieces, offsets = slice_lengths(lengths, start, stop)
    sequence_data = SequenceData() if sequence_data is None else sequence_data
    return Batch(pieces, past_lengths=offsets, sequence_data=sequence_data, device=device)


def slice_losses(slices: Sequence[Batch], names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """The named losses of a micro-batch run as `slices` (its micro-sequence chunks on this rank, in order, all of
    one sequence-data group): each plain loss summed over the chunks and the group's ranks, each statistics loss
    computed from its statistics summed so (`Batch.add_statistics_loss`). The same on every rank of the group; each
    rank's objective holds them once, their gradients reaching every rank's own tokens (`sum_over_slices`).
    `names`: only these (default: all that the first slice holds)."""
    first = slices[0]
    group = first.sequence_data.group
    wanted = [*first.losses, *first.statistics] if names is None else list(names)
    losses = {}
    for name in wanted:
        missing = [index for index, batch in enumerate(slices) if name not in batch.losses | batch.statistics]
        if missing:
            raise ValueError(
                f"the loss {name!r} was added by the first slice of a micro-batch, not by slice {missing[0]}"
            )
        if name in first.losses:
            losses[name] = sum_over_slices(sum(batch.losses[name] for batch in slices), group)
            continue
        keys, compute = first.statistics[name]
        summed = {key: sum(batch.statistics[name][0][key] for batch in slices) for key in keys}
        # One collective for all the statistics of the loss.
        flat = sum_over_slices(torch.cat([value.float().reshape(-1) for value in summed.values()]), group)
        parts = flat.split([value.numel() for value in summed.values()])
        losses[name] = compute({key: part.view_as(summed[key]) for key, part in zip(summed, parts)})
    return losses
