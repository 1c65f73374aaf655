"""`Batch`: a micro-batch of packed documents as the layers see it (docs/architecture.md "Packed sequences").

Documents are concatenated along one token dimension; `Batch` carries their boundaries (lengths, cumulative ends,
each token's document and position), placed on the device in one transfer, optionally padded to bucketed shapes so
a CUDA graph replays (`bucketed`), the metadata of a slice of longer sequences (`SequenceData`), the values layers
compute once per batch (`preprocessed`) and the losses layers add (`add_loss`, `add_statistics_loss`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import attrs
import torch
from torch.distributed import ProcessGroup

from blockzoo.layers.transfer import to_device_together

IGNORE_INDEX = -100  # The label of a token with no target (its next token is in another document, or absent).
# A statistics loss of a slice (`Batch.add_statistics_loss`): its statistics, and the loss as a function of their sums.
StatisticsLoss = tuple[dict[str, torch.Tensor], Callable[[dict[str, torch.Tensor]], torch.Tensor]]


def _document_index_and_positions(
    lengths: torch.Tensor, ends: torch.Tensor, past: torch.Tensor | None, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's document, and its position in it (counting the `past` tokens of its document: generation's cache,
    or a slice's earlier pieces): two running sums of per-token steps that change at document starts, which run on
    the host without a thread pool (`repeat_interleave` and a gather start one per call: every step pays for it)."""
    starts = ends[:-1]
    document_index = torch.zeros(num_tokens, dtype=torch.int64)
    document_index[starts] = 1
    steps = torch.ones(num_tokens, dtype=torch.int64)
    # At a document's start the position goes from the previous document's last one back to its own first one.
    first = torch.zeros_like(lengths) if past is None else past
    last = lengths - 1 + first
    steps[0] = first[0]
    steps[starts] = first[1:] - last[:-1]
    return document_index.cumsum(0), steps.cumsum(0)


@attrs.frozen
class SequenceData:
    """How a slice of longer sequences relates to the other slices of its step (see `Mixer.forward_slice`).

    `group`: the sequence-data-parallel group whose ranks hold the other slices of this step, at the same time
    (None: no other rank; a micro-sequence chunk run in one process). `rank`: this slice's index in the group (0
    with group None). `size`: the slices of the group (1 with group None). The slices of a group are consecutive
    tokens of equal lengths, in rank order.
    """

    group: ProcessGroup | None = None
    rank: int = 0
    size: int = 1

    def __attrs_post_init__(self) -> None:
        if self.group is None and (self.rank, self.size) != (0, 1):
            raise ValueError(f"a slice without a group is rank 0 of 1, got rank {self.rank} of {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"slice rank {self.rank} of {self.size}: need 0 <= rank < size")


class Batch:
    """The documents of one packed micro-batch, and what layers compute from them once.

    `lengths`: tokens of each document, in order. `past_lengths`: for generation, the tokens each
    document (sequence) already has in the layers' caches; positions continue from there.

    A slice of longer sequences (`sequence_data` set, see `slice_batch`): `lengths` are the slice's pieces of
    documents and `past_lengths` the tokens of each piece's document before the slice (only the first piece's can
    be > 0), so `positions` are positions in the whole document. `past_lengths` without `sequence_data` is
    generation: mixers tell the two apart by `state` and `sequence_data`, never by `past_lengths` alone.

    Every document has at least one token (an empty one is refused: drop it before making the batch), except in a
    padded batch (`document_capacity`, `length_bound`; see `bucketed`): empty documents come before its documents, up
    to `document_capacity` in all (in `lengths`, `cu_seqlens`, `document_index`, `num_documents`), and its
    `max_length` is `length_bound`, a bound on the documents' lengths rather than the longest; `padded` says whether
    it is one. Made on the host and copied to `device` once; its tensors, all on `device`:
    - `lengths` (int64, [documents]), `past_lengths` (int64 or None); `host_lengths`: `lengths` on the host, for
      what must not wait for the device;
    - `cu_seqlens` (int32, [documents + 1]): cumulative lengths from 0, as varlen attention kernels take them;
    - `document_index` (int64, [tokens]): each token's document; `positions` (int64, [tokens]): each token's position
      in its document, counting `past_lengths` (so the first new token of a document with 5 cached ones is at 5).
    Python ints: `num_tokens` (the sum of the lengths), `max_length`, `num_documents`, `continued` (on a slice: the
    tokens of the first piece's document before it); `is_slice` (whether `sequence_data` is set). `losses` /
    `statistics`: what layers add during the forward (`add_loss`, `add_statistics_loss`); `preprocessed(key,
    compute)` caches what layers compute from the batch.
    """

    def __init__(
        self,
        lengths: Sequence[int] | torch.Tensor,
        *,
        device: torch.device | str = "cpu",
        past_lengths: Sequence[int] | torch.Tensor | None = None,
        sequence_data: SequenceData | None = None,
        document_capacity: int | None = None,
        length_bound: int | None = None,
    ):
        # Everything is computed on the host from the lengths (a tensor on a device is read back once), then moved:
        # on a GPU, from pinned memory without waiting, so making a batch never stalls the device queue.
        self.device = torch.device(device)
        lengths_on_host = torch.as_tensor(lengths, dtype=torch.int64).cpu()
        as_list = lengths_on_host.tolist()
        if lengths_on_host.ndim != 1 or not as_list or min(as_list) <= 0:
            raise ValueError(f"document lengths must be a non-empty list of positive integers, got {lengths}")
        self.num_tokens = sum(as_list)
        self.max_length = max(as_list)
        ends = lengths_on_host.cumsum(0)
        past = None if past_lengths is None else torch.as_tensor(past_lengths, dtype=torch.int64).cpu()
        document_index, positions = _document_index_and_positions(lengths_on_host, ends, past, self.num_tokens)
        self.sequence_data = sequence_data
        # Tokens of the first piece's document before this slice, on the host (0 unless a slice continues one).
        self.continued = 0
        if sequence_data is not None and past is not None:
            if past.shape != lengths_on_host.shape or bool((past < 0).any()) or bool((past[1:] != 0).any()):
                raise ValueError(
                    f"a slice's past_lengths give the tokens of each piece's document before the slice: one per "
                    f"piece, >= 0, and only the first piece continues a document; got {past.tolist()} for pieces "
                    f"{as_list}"
                )
            self.continued = int(past[0])
        self.padded = document_capacity is not None or length_bound is not None
        if self.padded:
            room = _check_room(as_list, document_capacity, length_bound, past_lengths, sequence_data)
            # In front, where a layer's gather at each document's first token (cu_seqlens[:-1]) stays in range.
            lengths_on_host = torch.nn.functional.pad(lengths_on_host, (room, 0))
            ends = torch.nn.functional.pad(ends, (room, 0))
            document_index = document_index + room
            self.max_length = length_bound or self.max_length
        self.host_lengths = lengths_on_host  # the lengths on the host, for what must not wait for the device
        cu_seqlens = torch.nn.functional.pad(ends, (1, 0))  # int64 to travel with the rest; int32 once there
        self.lengths, cu_seqlens, self.document_index, self.positions, *past_lengths = to_device_together(
            [lengths_on_host, cu_seqlens, document_index, positions, *([] if past is None else [past])], self.device
        )
        self.cu_seqlens = cu_seqlens.to(torch.int32)
        self.past_lengths = past_lengths[0] if past_lengths else None
        # Losses layers add during the forward pass (MoE auxiliary losses...), named per layer.
        self.losses: dict[str, torch.Tensor] = {}
        # On a slice: the statistics of the losses that are functions of sums over all the sequence's tokens.
        self.statistics: dict[str, StatisticsLoss] = {}
        self._preprocessed: dict[Hashable, Any] = {}

    def clear_forward_state(self) -> None:
        """Forget what a forward pass left on this batch (its losses, statistics and preprocessed tensors), to run
        one again from the start: after a CUDA graph capture that stopped midway, whose tensors hold no values."""
        self.losses.clear()
        self.statistics.clear()
        self._preprocessed.clear()

    @classmethod
    def bucketed(cls, lengths: Sequence[int] | torch.Tensor, *, device: torch.device | str = "cpu") -> Batch:
        """The batch of `lengths` in shapes that most batches of its token count share, so that a CUDA graph captured
        on one replays on the others (`training.cuda_graphs`): documents all of one length as they are (their shapes
        repeat already, and attention takes them as rows); others padded with empty documents to a power of two, and
        `max_length` raised to a power of two (at most the token count)."""
        as_list = torch.as_tensor(lengths, dtype=torch.int64).cpu().tolist()
        if not as_list or min(as_list) <= 0 or len(set(as_list)) == 1:
            return cls(as_list, device=device)
        capacity = 1 << (len(as_list) - 1).bit_length()
        bound = min(1 << (max(as_list) - 1).bit_length(), sum(as_list))
        return cls(as_list, device=device, document_capacity=capacity, length_bound=bound)

    def copy_documents_(self, other: Batch) -> None:
        """Take the documents of `other`, a batch of the same shapes, into this batch's tensors in place: a CUDA graph
        captured on this batch then replays on them."""
        shapes = (self.num_tokens, self.num_documents, self.max_length)
        if (other.num_tokens, other.num_documents, other.max_length) != shapes or other.past_lengths is not None:
            raise ValueError(
                f"a batch of {other.num_tokens} tokens, {other.num_documents} documents, max_length "
                f"{other.max_length} cannot take the place of one of {shapes[0]}, {shapes[1]}, {shapes[2]}"
            )
        for mine, theirs in zip(self._documents(), other._documents()):
            mine.copy_(theirs)
        self.host_lengths = other.host_lengths

    def _documents(self) -> tuple[torch.Tensor, ...]:
        return self.lengths, self.cu_seqlens, self.document_index, self.positions

    @classmethod
    def from_documents(cls, documents: Sequence[torch.Tensor], **kwargs: Any) -> tuple[torch.Tensor, Batch]:
        """Concatenate token tensors into one packed tensor and its batch."""
        return torch.cat(list(documents)), cls([len(d) for d in documents], **kwargs)

    @property
    def num_documents(self) -> int:
        return len(self.lengths)

    @property
    def is_slice(self) -> bool:
        """Whether this batch is a slice of longer sequences (run with `Mixer.forward_slice`)."""
        return self.sequence_data is not None

    def preprocessed(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        """What `compute` returns, computed once per batch for each distinct `key`.

        Layers key their precomputed tensors (rotary tables, masks) by everything they depend on, so two
        blocks with different settings never share or overwrite an entry, and equal ones compute it once.
        """
        if key not in self._preprocessed:
            self._preprocessed[key] = compute()
        return self._preprocessed[key]

    def add_loss(self, name: str, value: torch.Tensor) -> None:
        """A loss (already weighted by its coefficient) added to the training objective and logged by `name`.

        On a slice of sequences the slices' values are added up (over the group and the micro-sequences), so the
        loss must be a sum over the tokens; one that is a function of such sums goes through `add_statistics_loss`."""
        if name in self.losses or name in self.statistics:
            raise ValueError(f"two layers add a loss named {name!r}")
        self.losses[name] = value

    def add_statistics_loss(
        self,
        name: str,
        statistics: dict[str, torch.Tensor],
        loss: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    ) -> None:
        """A named loss that is a function of sums over the tokens: `statistics` (name -> this batch's sum over its
        tokens: routings per expert, probabilities per expert, the token count, ...; differentiable or not) and
        `loss(statistics) -> loss`. On a whole micro-batch, `loss(statistics)` is added at once (`add_loss`); on a
        slice of sequences, the engine sums the statistics of every slice of the micro-batch (the group's ranks,
        through `sum_over_slices`, and the micro-sequences) and then adds `loss` of the sums, so the loss is that of
        the whole micro-batch, in every layout."""
        if self.sequence_data is None:
            self.add_loss(name, loss(statistics))
            return
        if name in self.losses or name in self.statistics:
            raise ValueError(f"two layers add a loss named {name!r}")
        self.statistics[name] = (statistics, loss)


def _check_room(lengths, document_capacity, length_bound, past_lengths, sequence_data) -> int:
    """The empty documents a padded batch adds; a ValueError for room that cannot hold the documents."""
    if past_lengths is not None or sequence_data is not None:
        raise ValueError("a padded batch holds whole documents: no past_lengths, no sequence_data")
    capacity = len(lengths) if document_capacity is None else document_capacity
    if capacity < len(lengths):
        raise ValueError(f"document_capacity {capacity} cannot hold {len(lengths)} documents")
    if length_bound is not None and length_bound < max(lengths):
        raise ValueError(f"length_bound {length_bound} is below the longest document's {max(lengths)} tokens")
    return capacity - len(lengths)
