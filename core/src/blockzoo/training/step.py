"""What one training step needs besides the model: its micro-batches on the device, and its figures on the host.

The host waits for the device only to read the figures the steps report and check (loss, gradient norm, named
losses: `StepFigures`), several steps' in one transfer (`to_host`). Everything else stays on the device: the
labelled-token count, the reductions, the clipping factor. The micro-batches of a step are placed on the device ahead
of time (`place_micro_batch`, called by the trainer while the previous step's work runs there): token and label
tensors and each `Batch`'s document tensors are computed on the host and copied from pinned memory without waiting.

Under sequence-data parallelism and micro-sequences a rank places only its slices of each micro-batch
(`own_slices`): the sequence-data ranks of one data rank read the same micro-batches and each takes its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from blockzoo.data.dataset import MicroBatch
from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.base import IGNORE_INDEX, Batch, SequenceData, slice_batch, slice_ranges, to_device_together


@attrs.frozen
class PlacedMicroBatch:
    """A micro-batch on the device: packed `tokens`, `labels` and their `batch`; or this rank's slices of it: the
    slices' tokens and labels, concatenated, and `batch` the slice's `Batch` (several: its micro-sequence chunks, in
    order)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    batch: Batch | tuple[Batch, ...]

    def labelled(self) -> torch.Tensor:
        """The count of labelled tokens, on the device (fp32)."""
        return (self.labels != IGNORE_INDEX).sum(dtype=torch.float32)


@attrs.frozen
class StepFigures:
    """What step `step` reports, on the device until the host reads it: `values` (fp32, on the device) holds the
    loss, the gradient norm, then the named losses in the order of `names`."""

    step: int
    learning_rate: float
    names: tuple[str, ...]
    values: torch.Tensor


@attrs.frozen
class StepData:
    """The micro-batches of one optimizer step on this rank, placed on the device, with what the host knows of them:
    `position`, the data position after them (for checkpoints); `tokens` and `flops`, of all data ranks together."""

    micro_batches: list[PlacedMicroBatch]
    position: Any
    tokens: int
    flops: int


def own_slices(tokens: int, distributed: Distributed) -> list[tuple[int, int]]:
    """The token ranges [start, stop) of a micro-batch of `tokens` tokens this rank runs, in order (`slice_ranges`:
    step c of N sequence-data ranks with chunks of L = `micro_sequence_length` covers [c·N·L, (c+1)·N·L))."""
    config = distributed.config
    return slice_ranges(
        tokens, config.sequence_data_parallel, distributed.sequence_data_rank, config.micro_sequence_length
    )


def place_micro_batch(micro: MicroBatch, distributed: Distributed, *, bucketed: bool = False) -> PlacedMicroBatch:
    """`micro` on the device of `distributed`: all of it, or this rank's slices when the run uses them
    (`distributed.config.uses_slices`). `bucketed`: a whole micro-batch's `Batch` in the shapes of `Batch.bucketed`
    (for CUDA graphs)."""
    device = distributed.device
    if not distributed.config.uses_slices:
        tokens, labels = to_device_together([micro.tokens, micro.labels], device)
        batch = (Batch.bucketed if bucketed else Batch)(micro.lengths, device=device)
        return PlacedMicroBatch(tokens=tokens, labels=labels, batch=batch)
    ranges = own_slices(len(micro.tokens), distributed)
    lengths = micro.lengths.tolist()
    sequence_data = SequenceData(
        group=distributed.sequence_data_group if distributed.sequence_data_size > 1 else None,
        rank=distributed.sequence_data_rank,
        size=distributed.sequence_data_size,
    )
    batches = tuple(
        slice_batch(lengths, start, stop, sequence_data=sequence_data, device=device) for start, stop in ranges
    )
    tokens, labels = to_device_together(
        [
            torch.cat([micro.tokens[start:stop] for start, stop in ranges]),
            torch.cat([micro.labels[start:stop] for start, stop in ranges]),
        ],
        device,
    )
    return PlacedMicroBatch(tokens=tokens, labels=labels, batch=batches[0] if len(batches) == 1 else batches)


def to_host(values: Sequence[torch.Tensor]) -> list[float]:
    """The tensors `values` (of any shapes), flattened one after the other, as Python floats: one device→host
    transfer, the only wait for the device of a training step (and of several, when they are read together)."""
    return torch.cat([value.detach().float().reshape(-1) for value in values]).tolist()
