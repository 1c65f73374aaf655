"""What one training step needs besides the model: its micro-batches on the device, and its figures on the host.

The host never waits for the device during a step but once: `to_host` brings every figure the step reports and
checks (loss, gradient norm, named losses) back in one transfer, before the optimizer step, so that a non-finite
value stops the run before it reaches the weights. Everything else stays on the device: the labelled-token count,
the reductions, the clipping factor. The micro-batches of a step are placed on the device ahead of time
(`place_micro_batches`, called by the trainer while the previous step's work runs there): token and label tensors
and each `Batch`'s document tensors are computed on the host and copied from pinned memory without waiting.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from blockzoo.data.dataset import MicroBatch
from blockzoo.layers.base import IGNORE_INDEX, Batch, to_device


@attrs.frozen
class PlacedMicroBatch:
    """A micro-batch on the device: packed `tokens`, `labels` and their `batch`."""

    tokens: torch.Tensor
    labels: torch.Tensor
    batch: Batch

    def labelled(self) -> torch.Tensor:
        """The count of labelled tokens, on the device (fp32)."""
        return (self.labels != IGNORE_INDEX).sum(dtype=torch.float32)


@attrs.frozen
class StepData:
    """The micro-batches of one optimizer step on this rank, placed on the device, with what the host knows of them:
    `position`, the data position after them (for checkpoints); `tokens` and `flops`, of all data ranks together."""

    micro_batches: list[PlacedMicroBatch]
    position: Any
    tokens: int
    flops: int


def place_micro_batch(micro: MicroBatch, device: torch.device) -> PlacedMicroBatch:
    return PlacedMicroBatch(
        tokens=to_device(micro.tokens, device),
        labels=to_device(micro.labels, device),
        batch=Batch(micro.lengths, device=device),
    )


def to_host(values: Sequence[torch.Tensor]) -> list[float]:
    """The one device→host transfer of a step: every figure it reports and checks, as Python floats."""
    return torch.stack([value.detach().float().reshape(()) for value in values]).tolist()
