"""Helpers for attention over slices of longer sequences (sequence-data parallelism, micro-sequences).

Public so that other attention-like mixers (multi-head latent attention, for one) carry and read their key blocks the
same way `blockzoo_attention.attention.Attention.forward_slice` does: the keys of the tokens before a slice are kept
as the blocks they were gathered in (never concatenated), and a slice reads one contiguous stretch of them.
"""

from __future__ import annotations

import torch

from blockzoo.api import Batch
from blockzoo_attention.kernels import Segments


def stretch(blocks: tuple[torch.Tensor, ...], start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of the blocks concatenated, copying only the blocks that hold them."""
    parts, offset = [], 0
    for block in blocks:
        end = offset + len(block)
        if end > start and offset < stop:
            parts.append(block[max(start - offset, 0) : min(stop, end) - offset])
        offset = end
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def last_rows(blocks: tuple[torch.Tensor, ...], rows: int) -> tuple[torch.Tensor, ...]:
    """The blocks holding the last `rows` rows of their concatenation (the first of them cut: a view)."""
    kept, total = [], 0
    for block in reversed(blocks):
        if total >= rows:
            break
        kept.append(block if total + len(block) <= rows else block[len(block) - (rows - total) :])
        total += len(kept[-1])
    return tuple(reversed(kept))


def slice_keys(batch: Batch, seen: int) -> Segments:
    """Where the documents of a slice's queries lie in the stretch of keys they see: the first piece's document
    from `seen` tokens before the slice, then every other piece in the slice."""
    lengths = batch.host_lengths.clone()
    lengths[0] += seen
    keys = Segments.from_lengths(lengths)
    first = torch.arange(int(lengths[0])) + (batch.continued - seen)
    positions = torch.cat([first, keys.positions[int(lengths[0]) :]])
    device = batch.device
    return keys._replace(
        cu_seqlens=keys.cu_seqlens.to(device),
        document_index=keys.document_index.to(device),
        positions=positions.to(device),
    )
