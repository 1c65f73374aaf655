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

from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch
from torch import nn

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


class StepDataReader:
    """Reads a run's steps: each step's `gradient_accumulation` micro-batches of this rank, placed on the device
    (without waiting for it; `bucketed` for CUDA graphs), with their tokens and FLOPs of all data ranks."""

    def __init__(self, model: nn.Module, distributed: Distributed, gradient_accumulation: int, *, bucketed: bool):
        self.model, self.distributed = model, distributed
        self.gradient_accumulation, self.bucketed = gradient_accumulation, bucketed
        self._flops_by_lengths: dict[tuple[int, ...], int] = {}

    def next(self, batches: Iterator[MicroBatch]) -> StepData:
        """The next step's data from `batches` (a `TrainingBatches`: its position after them)."""
        micro_batches = [next(batches) for _ in range(self.gradient_accumulation)]
        flops = sum(self._flops(tuple(micro.lengths.tolist())) for micro in micro_batches)
        data_size = self.distributed.data_size
        return StepData(
            micro_batches=[
                place_micro_batch(micro, self.distributed, bucketed=self.bucketed) for micro in micro_batches
            ],
            position=batches.position(),
            tokens=sum(len(micro.tokens) for micro in micro_batches) * data_size,
            flops=flops * data_size,
        )

    def _flops(self, lengths: tuple[int, ...]) -> int:
        """Forward + backward FLOPs of a micro-batch of documents of `lengths`, by the layers' counts: remembered per
        lengths, since counting walks every layer on the host, inside a step that the host may bound (3.5 ms of a
        100M model's step on a slow CPU); whole rows and fixed lengths hit every time."""
        if lengths not in self._flops_by_lengths:
            if len(self._flops_by_lengths) >= 4096:  # documents of ever new lengths: keep it bounded
                self._flops_by_lengths.clear()
            forward, backward = self.model.flops(Batch(list(lengths)))
            self._flops_by_lengths[lengths] = forward + backward
        return self._flops_by_lengths[lengths]
