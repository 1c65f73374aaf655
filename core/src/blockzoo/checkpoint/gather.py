"""Streaming a checkpoint's tensors across ranks: each parameter (and its optimizer state) gathered to its global
shape one at a time, written by the one rank that holds it first, and freed; the ranks agree on every failure."""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn

from blockzoo.checkpoint.format import (
    OPTIMIZER_FILE,
    CheckpointError,
    NonFiniteError,
    describe,
    global_shape,
    saved_parameters,
)
from blockzoo.checkpoint.space import no_space
from blockzoo.distributed.data_parallel import whole
from blockzoo.distributed.runtime import Distributed
from blockzoo.safetensors_io import SafetensorsWriter

# A tensor to write: (its parameter, this rank's part of it, the global dtype and shape).
Entry = tuple[nn.Parameter, torch.Tensor, torch.dtype, tuple[int, ...]]


def weights_of(model: nn.Module, *, adapters_only: bool = False) -> Iterator[tuple[str, Entry]]:
    for name, parameter in saved_parameters(model, adapters_only).items():
        yield name, (parameter, parameter.detach(), parameter.dtype, global_shape(parameter))


def optimizer_state_of(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer
) -> Iterator[tuple[str, Entry]]:
    for name, parameter in model.named_parameters():
        for key, value in optimizer.state.get(parameter, {}).items():
            if not isinstance(value, torch.Tensor) or value.shape not in (parameter.shape, torch.Size()):
                raise CheckpointError(
                    directory / OPTIMIZER_FILE,
                    f"optimizer state {key!r} of parameter {name!r} is {describe(value)}; only scalars and tensors "
                    f"shaped like the parameter {tuple(parameter.shape)} can be saved",
                )
            shape = global_shape(parameter) if value.ndim else ()
            yield f"{name}/{key}", (parameter, value, value.dtype, shape)


@attrs.frozen
class Layout:
    """A file's tensors (name → dtype, global shape) in file order, and those this rank writes."""

    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    writes: frozenset[str]


def file_layout(entries: Mapping[str, Entry], distributed: Distributed) -> Layout:
    """The file's layout: this rank's tensors, and under pipeline parallelism those of every stage (each tensor is
    written by the first rank of the first stage holding it, e.g. a weight tied between the first and last)."""
    mine = {name: (dtype, shape) for name, (_, _, dtype, shape) in entries.items()}
    stage_writer = distributed.tensor_rank == 0 and distributed.data_rank == 0 and distributed.sequence_data_rank == 0
    if distributed.config.pipeline_parallel == 1:
        return Layout(mine, frozenset(mine) if stage_writer else frozenset())
    stages: list[Any] = [None] * distributed.config.pipeline_parallel
    # Names, dtypes and shapes only (plain data between our own processes).
    dist.all_gather_object(stages, mine, group=distributed.pipeline_group)
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    holder: dict[str, int] = {}
    for stage, layout in enumerate(stages):
        for name, entry in layout.items():
            tensors.setdefault(name, entry)
            holder.setdefault(name, stage)
    writes = {name for name in mine if holder[name] == distributed.pipeline_rank} if stage_writer else set()
    return Layout(tensors, frozenset(writes))


def stream_tensors(
    directory: Path,
    temporary: Path,
    tensors: Mapping[str, Mapping[str, Entry]],
    layouts: Mapping[str, Layout],
    distributed: Distributed,
) -> BaseException | None:
    """Gather every tensor (all ranks, in one order) and write those this rank writes: rank 0 makes each file with
    its header (the ranks agreed that the directory is ready before), the other writers open it. A failure to write
    stops the writing, not the gathering, so that no rank waits forever in a collective; it is returned."""
    failure: BaseException | None = None
    writers: dict[str, SafetensorsWriter] = {}
    # Rank 0 makes the files first; the other writers (pipeline stages) open them once every rank is past that.
    for creating in (True, False):
        try:
            for file, layout in layouts.items():
                if (distributed.rank == 0) == creating and (creating or layout.writes):
                    writers[file] = SafetensorsWriter(
                        temporary / file, layout.tensors, create=creating, writes=layout.writes
                    )
        except BaseException as error:  # noqa: BLE001 - the other ranks must hear of it before it is raised
            failure = failure or error
        if creating and distributed.config.pipeline_parallel > 1:
            dist.barrier()
    for file, entries in tensors.items():
        for name, (parameter, value, _, _) in entries.items():
            tensor = _to_global(value, parameter, distributed)
            if failure is None and name in layouts[file].writes:
                try:
                    if tensor.is_floating_point() and not _all_finite(tensor):
                        raise NonFiniteError(
                            directory / file,
                            f"tensor {name!r} has non-finite values (nan or inf); refusing to save it",
                        )
                    writers[file].write(name, tensor)
                except BaseException as error:  # noqa: BLE001
                    failure = error
            del tensor  # one global tensor at a time
    for writer in writers.values():
        try:
            # Rank 0 fsyncs its files in `_finish`, after hashing them while the disk writes their last bytes; the
            # other writers (pipeline stages, maybe on other hosts: an fsync syncs one host's pages) sync their own.
            writer.close(complete=failure is None, sync=distributed.rank != 0)
        except BaseException as error:  # noqa: BLE001
            failure = failure or error
    return failure


def _all_finite(tensor: torch.Tensor) -> bool:
    """No nan nor inf in `tensor`. A sum with one is never finite (nan propagates, inf + -inf is nan), so a finite
    sum proves it in one fast pass (`isfinite` is 18x slower, measured); only a non-finite sum (a non-finite value, or
    an overflow of finite ones: common in fp16) is checked value by value."""
    if tensor.dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16) and bool(
        torch.isfinite(tensor.sum())
    ):
        return True
    return bool(torch.isfinite(tensor).all())


def _to_global(tensor: torch.Tensor, parameter: nn.Parameter, distributed: Distributed) -> torch.Tensor:
    """The global tensor of a parameter-shaped `tensor` (or a scalar as it is), on the CPU: gathered over the data
    ranks when FSDP shards it, then over the tensor ranks, and over the data ranks for a parameter split there
    (experts). Every rank of those groups takes part."""
    if tensor.ndim == 0:
        return tensor.detach().cpu()
    tensor = whole(tensor.detach())
    meta = getattr(parameter, "meta", None)
    if meta is not None:  # Parameters not made by the parameter factory are replicated.
        tensor = meta.local_to_global(tensor, distributed.tensor_group, distributed.data_group)
    return tensor.cpu().contiguous()


def agree(
    distributed: Distributed,
    failure: BaseException | None,
    directory: Path,
    cleanup: Path | None = None,
    needed: int = 0,
) -> None:
    """Every rank learns whether any failed (and none runs ahead): a failed rank re-raises its error (a full disk as
    a `CheckpointError` naming the space `needed`), the others a `CheckpointError`; rank 0 then removes `cleanup`,
    the unfinished checkpoint."""
    failed = failure is not None
    if distributed.world_size > 1:
        flag = torch.tensor([int(failed)], dtype=torch.int32, device=distributed.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        failed = bool(flag.item())
    if not failed:
        return
    if cleanup is not None and distributed.rank == 0:
        shutil.rmtree(cleanup, ignore_errors=True)
    if _is_disk_full(failure):
        raise CheckpointError(directory, no_space(directory.parent, needed)) from None
    if failure is not None:
        raise failure
    raise CheckpointError(directory, "another rank failed to write the checkpoint (its error is in its log)")


def _is_disk_full(error: BaseException | None) -> bool:
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        error = error.__cause__ or error.__context__
    return False
