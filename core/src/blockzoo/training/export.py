"""The export at the end of a run (`training.export_format`): rank 0 converts the latest checkpoint, the other ranks
wait to hear whether it did."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from blockzoo.distributed.runtime import Distributed
from blockzoo.python_api import convert
from blockzoo.training.config import TrainingConfig
from blockzoo.training.signals import TrainingError


def export_checkpoint(
    checkpoint: Path, config: TrainingConfig, distributed: Distributed, log: Callable[[str], None]
) -> Path:
    """Convert `checkpoint` to `config.export_format` at `config.export_dir` (default `<output_dir>/<format>`)."""
    export_format = config.export_format
    destination = Path(config.export_dir or Path(config.output_dir) / export_format)
    failure: BaseException | None = None
    if distributed.rank == 0:
        try:
            convert(checkpoint, destination, format=export_format)
        except BaseException as error:  # noqa: BLE001 - the other ranks must hear of it before it is raised
            failure = error
    if distributed.world_size > 1:
        failed = torch.tensor([failure is not None], dtype=torch.int32, device=distributed.device)
        dist.broadcast(failed, src=0)
        if failed.item() and failure is None:
            raise TrainingError(f"rank 0 failed to export to {destination} (its error is in its log)")
    if failure is not None:
        raise failure
    log(f"exported {destination} ({export_format})")
    return destination
