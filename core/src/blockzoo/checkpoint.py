"""Native checkpoints (DESIGN.md "Checkpoints and formats").

A checkpoint is a directory:

- `config.yaml`: the full resolved run config;
- `metadata.yaml`: the format version, the blockzoo version, every plugin whose types the config uses
  (name, distribution, version, types), the step, the data position (`data`), any other trainer state
  (`extra`, plain YAML data) and the files written;
- `model.safetensors`: every parameter as its global tensor, whatever the parallel layout, under its
  name in `model.named_parameters()` (tied parameters once);
- `optimizer.safetensors` (when an optimizer is given): each parameter's optimizer state as
  `<parameter name>/<state key>` (AdamW: `step`, `exp_avg`, `exp_avg_sq`); a state tensor shaped like
  its parameter is stored global like it, a scalar as it is;
- `origin/` (when the model was imported from another format): copies of that checkpoint's files other than its
  weights (`blockzoo.conversion.Origin`: its config, tokenizer, generation settings), for exports to give back.

A PEFT fine-tuning's checkpoint may hold its adapters only (`save_checkpoint(base=...)`): `model.safetensors` then
has the adapter parameters alone (their optimizer state is all there is anyway) and `metadata.yaml` a `base` entry
naming the checkpoint the frozen weights come from (`blockzoo.model.factory.base_reference`: its path, format, model
config and weight files' checksums). Loading such a checkpoint fills the adapters only; the caller loads the base
first and says so (`base_loaded`), after checking it is the one recorded (`blockzoo.model.factory.load_base`).

No pickle: tensors go to safetensors, everything else to YAML. Saving streams the tensors: the ranks gather one
global tensor at a time (FSDP shards over the data ranks, tensor-parallel shards over the tensor ranks, experts of
expert parallelism over the data ranks), its writer puts it at its place in the file, and it is freed, so no rank
holds a whole model. Rank 0 makes the files, sized with their headers, in a temporary directory beside the target;
each tensor is written by the first rank (tensor, data rank 0) of the first pipeline stage holding it, so that the
stages of a pipeline write their own tensors into the one file (the checkpoint directory must then be on a file
system all writing ranks see, as for any checkpoint of a run over several machines). Rank 0 then writes the YAML
files and renames the directory, so a crash mid-save leaves the previous checkpoint as it was. Loading, each rank
takes its own shard of every global tensor, so any parallel layout loads a checkpoint of any other.

Reliability (docs/architecture.md "Checkpoints"): `metadata.yaml` records a checksum of every other file
(`checksums`, verified on load; older checkpoints without it still load); a tensor is refused when its dtype is not
the one the model (or optimizer) holds; a non-finite tensor is never saved; the space a checkpoint needs is checked
before writing; pruning renames a directory to `.<name>.deleting` before removing it, so no half-deleted directory
looks complete; `latest_checkpoint` skips (and reports) checkpoints that fail verification.
"""

from __future__ import annotations

import errno
import hashlib
import math
import mmap
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
import yaml
from packaging.version import InvalidVersion, Version
from torch import nn

from blockzoo import __version__
from blockzoo.config import Config, PolymorphicConfig, to_yaml
from blockzoo.conversion import ConversionError, Origin
from blockzoo.distributed.data_parallel import shard_like, whole
from blockzoo.distributed.runtime import Distributed
from blockzoo.errors import UsageError
from blockzoo.loading import fill_parameter
from blockzoo.peft.apply import is_adapter_parameter
from blockzoo.plugins import get_registry
from blockzoo.safetensors_io import SafetensorsReader, SafetensorsWriter

FORMAT_VERSION = 1
CONFIG_FILE = "config.yaml"
METADATA_FILE = "metadata.yaml"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
ORIGIN_DIRECTORY = "origin"
_STEP_DIRECTORY = re.compile(r"step_(\d+)")
# The SHA-256 of the concatenated SHA-256 digests of the file's 16 MiB chunks: hashed by several threads at once
# (hashlib releases the GIL), about 0.25 s for 500 MB on 2 cores.
CHECKSUM_ALGORITHM = "sha256-16MiB-chunks"
_CHUNK = 16 * 2**20
_CHECKSUM_PIECE = 2**20  # a multiple of the page size: each piece's pages are unmapped once hashed
# Room for headers, YAML files and the file system's own blocks, beyond the tensors' bytes.
_SPACE_MARGIN = 4 * 2**20


class CheckpointError(UsageError):
    """A checkpoint cannot be written or read as asked; names the file and what is wrong."""

    def __init__(self, path: str | Path, problem: str):
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{path}: {problem}")


# ---------------------------------------------------------------------------------------------------------------------
# Saving


def save_checkpoint(
    directory: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    run_config: Config,
    step: int,
    distributed: Distributed,
    data_state: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    origin: Origin | None = None,
    keep: int | None = None,
    log: Callable[[str], None] | None = None,
    base: Mapping[str, Any] | None = None,
) -> Path:
    """Write a checkpoint of `model` (and `optimizer`) to `directory`. Every rank calls it.

    The tensors are streamed: each is gathered to its global shape (over the data ranks for FSDP shards and
    experts, over the tensor ranks for tensor-parallel ones), written at its place in the file and freed, so no rank
    ever holds more than one global tensor. The first rank of the first pipeline stage holding a tensor writes it;
    rank 0 makes the files (their layout merged over the pipeline stages) and the YAML files.

    `data_state` is the data position, `extra` any other trainer state: plain YAML data (numbers, strings,
    lists, mappings, bytes); `origin`, the files of the checkpoint the model was imported from, copied into
    `origin/`. An existing checkpoint at `directory` is replaced only once the new one is complete; a `directory`
    that is not a checkpoint is moved aside (to `<name>.not-a-checkpoint`), never replaced.

    Before writing, rank 0 checks that the file system has room for the checkpoint; with `keep` (the run's
    `checkpoint_keep`) and too little room, it first prunes the oldest `step_<N>` siblings the pruning after the save
    would remove anyway (down to `keep - 1`, never fewer than one). No room: a `CheckpointError` naming the directory
    and the space needed. A tensor with a non-finite value is refused (`CheckpointError`), so no checkpoint with one is
    ever written. `log` (rank 0) hears of what was moved aside or pruned early.

    `base` (a PEFT fine-tuning's, `blockzoo.model.factory.base_reference`): the weights file holds the adapters
    only, and the metadata records `base`, where the frozen weights are to be read from.
    """
    directory = Path(directory)
    log = log or (lambda _: None)
    files = [MODEL_FILE] if optimizer is None else [MODEL_FILE, OPTIMIZER_FILE]
    files += [f"{ORIGIN_DIRECTORY}/{name}" for name in (origin.files if origin else ())]
    metadata = {
        "format_version": FORMAT_VERSION,
        "blockzoo_version": __version__,
        "step": step,
        "plugins": _plugins_used(run_config),
        "data": dict(data_state or {}),
        "extra": dict(extra or {}),
        "files": files,
    }
    if base is not None:
        metadata["base"] = dict(base)
    # Checked on every rank before any collective, so that bad trainer state fails everywhere alike.
    _yaml_text(metadata, "the checkpoint metadata (data_state, extra)")
    config = to_yaml(run_config)
    tensors = {MODEL_FILE: dict(_weights_of(model, adapters_only=base is not None))}
    if optimizer is not None:
        tensors[OPTIMIZER_FILE] = dict(_optimizer_state_of(directory, model, optimizer))
    layouts = {file: _layout(entries, distributed) for file, entries in tensors.items()}
    needed = _space_needed(layouts, config, origin)
    temporary = directory.parent / f".{directory.name}.partial"
    failure: BaseException | None = None
    if distributed.rank == 0:
        try:
            _prepare(directory, temporary, needed=needed, keep=keep, log=log)
        except BaseException as error:  # noqa: BLE001 - the other ranks must hear of it before it is raised
            failure = error
    _agree(distributed, failure, directory, needed=needed)
    failure = _stream(directory, temporary, tensors, layouts, distributed)
    _agree(distributed, failure, directory, cleanup=temporary, needed=needed)
    if distributed.rank == 0:
        try:
            _finish(directory, temporary, config=config, metadata=metadata, origin=origin)
        except BaseException as error:  # noqa: BLE001
            failure = error
    _agree(distributed, failure, directory, cleanup=temporary, needed=needed)
    return directory


# A tensor to write: (its parameter, this rank's part of it, the global dtype and shape).
_Entry = tuple[nn.Parameter, torch.Tensor, torch.dtype, tuple[int, ...]]


def _weights_of(model: nn.Module, *, adapters_only: bool = False) -> Iterator[tuple[str, _Entry]]:
    for name, parameter in _saved_parameters(model, adapters_only).items():
        yield name, (parameter, parameter.detach(), parameter.dtype, _global_shape(parameter))


def _saved_parameters(model: nn.Module, adapters_only: bool) -> dict[str, nn.Parameter]:
    """The parameters a checkpoint's weights file holds: all, or (a PEFT checkpoint with a base) the adapters."""
    parameters = dict(model.named_parameters())
    if adapters_only:
        return {name: parameter for name, parameter in parameters.items() if is_adapter_parameter(name)}
    return parameters


def _optimizer_state_of(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer
) -> Iterator[tuple[str, _Entry]]:
    for name, parameter in model.named_parameters():
        for key, value in optimizer.state.get(parameter, {}).items():
            if not isinstance(value, torch.Tensor) or value.shape not in (parameter.shape, torch.Size()):
                raise CheckpointError(
                    directory / OPTIMIZER_FILE,
                    f"optimizer state {key!r} of parameter {name!r} is {_describe(value)}; only scalars and tensors "
                    f"shaped like the parameter {tuple(parameter.shape)} can be saved",
                )
            shape = _global_shape(parameter) if value.ndim else ()
            yield f"{name}/{key}", (parameter, value, value.dtype, shape)


@attrs.frozen
class _Layout:
    """A file's tensors (name → dtype, global shape) in file order, and those this rank writes."""

    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    writes: frozenset[str]


def _layout(entries: Mapping[str, _Entry], distributed: Distributed) -> _Layout:
    """The file's layout: this rank's tensors, and under pipeline parallelism those of every stage (each tensor is
    written by the first rank of the first stage holding it, e.g. a weight tied between the first and last)."""
    mine = {name: (dtype, shape) for name, (_, _, dtype, shape) in entries.items()}
    stage_writer = distributed.tensor_rank == 0 and distributed.data_rank == 0 and distributed.sequence_data_rank == 0
    if distributed.config.pipeline_parallel == 1:
        return _Layout(mine, frozenset(mine) if stage_writer else frozenset())
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
    return _Layout(tensors, frozenset(writes))


def _space_needed(layouts: Mapping[str, _Layout], config: str, origin: Origin | None) -> int:
    """Bytes the checkpoint takes on disk (the tensors' bytes are known from the layouts), with a margin."""
    tensors = sum(
        math.prod(shape) * dtype.itemsize for layout in layouts.values() for dtype, shape in layout.tensors.values()
    )
    origin_files = sum(path.stat().st_size for path in origin.paths() if path.is_file()) if origin else 0
    return tensors + len(config) + origin_files + _SPACE_MARGIN


def _prepare(directory: Path, temporary: Path, *, needed: int, keep: int | None, log: Callable[[str], None]) -> None:
    if directory.exists() and not (directory / METADATA_FILE).is_file() and any(directory.iterdir()):
        if not _STEP_DIRECTORY.fullmatch(directory.name):
            raise CheckpointError(directory, "exists and is not a checkpoint; refusing to replace it")
        # A run's own step directory (a save interrupted before `_replace`, a hand edit): kept, but out of the way.
        aside = _free_name(directory.parent / f"{directory.name}.not-a-checkpoint")
        directory.rename(aside)
        log(f"{directory} exists and is not a checkpoint (no {METADATA_FILE}): moved it aside to {aside}")
    directory.parent.mkdir(parents=True, exist_ok=True)
    if temporary.exists():  # Left by a save that crashed.
        shutil.rmtree(temporary)
    _make_room(directory, needed, keep, log)
    temporary.mkdir()


def _free_name(path: Path) -> Path:
    """`path`, or `path.1`, `path.2`, ...: the first that does not exist."""
    candidate, number = path, 0
    while candidate.exists():
        number += 1
        candidate = path.with_name(f"{path.name}.{number}")
    return candidate


def _make_room(directory: Path, needed: int, keep: int | None, log: Callable[[str], None]) -> None:
    """Raise unless the file system of `directory` has `needed` bytes free; with `keep`, prune the oldest `step_<N>`
    siblings first, down to `keep - 1` (the save and the pruning after it leave `keep`), never below one."""
    root = directory.parent
    free = shutil.disk_usage(root).free
    if free >= needed:
        return
    others = [path for _, path in _step_directories(root) if path != directory]
    while keep is not None and free < needed and len(others) > max(keep - 1, 1):
        oldest = others.pop(0)
        _remove(oldest)
        log(f"pruned {oldest} before saving {directory.name}: {_size(free)} free, the checkpoint needs {_size(needed)}")
        free = shutil.disk_usage(root).free
    if free < needed:
        raise CheckpointError(directory, _no_space(root, needed, free))


def _no_space(root: Path, needed: int, free: int | None = None) -> str:
    """The message of a full disk: before writing (`free` known), or found while writing (free: now)."""
    what = "not enough disk space to save the checkpoint" if free is not None else "the disk filled up while saving"
    free = shutil.disk_usage(root).free if free is None else free
    return (
        f"{what}: it needs about {_size(needed)}, {_size(free)} are free on the file system of {root} (free some "
        "space, or lower training.checkpoint_keep)"
    )


def _size(count: int) -> str:
    return f"{count / 2**20:.1f} MiB"


def _stream(
    directory: Path,
    temporary: Path,
    tensors: Mapping[str, Mapping[str, _Entry]],
    layouts: Mapping[str, _Layout],
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


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _plugins_used(run_config: Config) -> dict[str, dict[str, Any]]:
    """Every plugin that provides a type the config uses: its distribution, version and those types."""
    registry = get_registry()
    plugins: dict[str, dict[str, Any]] = {}
    for node in _polymorphic_nodes(run_config):
        name = registry.name_of(type(node))
        record = registry.resolve(node.kind, name).plugin
        entry = plugins.setdefault(
            record.name, {"distribution": record.distribution, "version": record.version, "types": []}
        )
        if f"{node.kind}:{name}" not in entry["types"]:
            entry["types"].append(f"{node.kind}:{name}")
    for entry in plugins.values():
        entry["types"].sort()
    return dict(sorted(plugins.items()))


def _polymorphic_nodes(value: Any) -> Iterator[PolymorphicConfig]:
    if isinstance(value, PolymorphicConfig):
        yield value
    if isinstance(value, Config):
        for attribute in attrs.fields(type(value)):
            yield from _polymorphic_nodes(getattr(value, attribute.name))
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _polymorphic_nodes(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _polymorphic_nodes(item)


def _yaml_text(data: Mapping[str, Any], what: str) -> str:
    try:
        return yaml.safe_dump(dict(data), sort_keys=False)
    except yaml.YAMLError as error:
        raise ValueError(f"{what} must be plain data (numbers, strings, lists, mappings, bytes): {error}") from None


def _finish(
    directory: Path, temporary: Path, *, config: str, metadata: Mapping[str, Any], origin: Origin | None
) -> None:
    """Complete the checkpoint whose tensor files are written in `temporary` (its checksums in the metadata, written
    last), then put it at `directory`."""
    try:
        (temporary / CONFIG_FILE).write_text(config)
        if origin is not None:
            _copy_origin(origin, temporary / ORIGIN_DIRECTORY)
        checked = [CONFIG_FILE, *metadata["files"]]
        checksums = {file: file_checksum(temporary / file) for file in checked}
        metadata = {**metadata, "checksums": {"algorithm": CHECKSUM_ALGORITHM, "files": checksums}}
        (temporary / METADATA_FILE).write_text(_yaml_text(metadata, "the checkpoint metadata"))
        for path in temporary.rglob("*"):
            _fsync(path)
        _replace(temporary, directory)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    _fsync(directory.parent)


def record_checksum(directory: Path, file: str) -> None:
    """Record the checksum of `file` of the checkpoint at `directory` anew, for a file written after the checkpoint
    (a converter that streams the weights into a checkpoint saved without them). The metadata is replaced
    atomically."""
    metadata = _read_yaml(directory / METADATA_FILE)
    checksums = metadata.get("checksums")
    if not isinstance(checksums, dict) or file not in checksums.get("files", {}):
        raise CheckpointError(directory / METADATA_FILE, f"records no checksum of {file} to update")
    checksums["files"][file] = file_checksum(directory / file)
    temporary = directory / f".{METADATA_FILE}.new"
    temporary.write_text(_yaml_text(metadata, "the checkpoint metadata"))
    _fsync(temporary)
    temporary.replace(directory / METADATA_FILE)


def _copy_origin(origin: Origin, destination: Path) -> None:
    destination.mkdir()
    for path in origin.paths():
        if not path.is_file():
            raise CheckpointError(path, "is gone: the model's origin files are needed to save it (with the checkpoint)")
        shutil.copyfile(path, destination / path.name)


def _replace(source: Path, target: Path) -> None:
    """Rename `source` to `target`; an existing `target` is moved aside first and removed last."""
    if not target.exists():
        source.rename(target)
        return
    previous = target.parent / f".{target.name}.previous"
    if previous.exists():
        shutil.rmtree(previous)
    target.rename(previous)
    try:
        source.rename(target)
    except BaseException:  # (a second stop signal, ...) the previous checkpoint goes back, not lost from view
        previous.rename(target)
        raise
    shutil.rmtree(previous)


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _agree(
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
        raise CheckpointError(directory, _no_space(directory.parent, needed)) from None
    if failure is not None:
        raise failure
    raise CheckpointError(directory, "another rank failed to write the checkpoint (its error is in its log)")


def _is_disk_full(error: BaseException | None) -> bool:
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        error = error.__cause__ or error.__context__
    return False


def file_checksum(path: Path, data: torch.Tensor | None = None) -> str:
    """The file's checksum (`CHECKSUM_ALGORITHM`): its 16 MiB chunks hashed by several threads, then their digests.
    `data`: the file's bytes as a mapped uint8 tensor (`SafetensorsReader.mapped_file`), hashed where they are
    (no copy; a loader's tensors are views of the same map), else the file is mapped here for the hashing."""
    if data is not None:
        return _chunked_checksum(data.numpy() if len(data) else b"", unmap=None)
    size = path.stat().st_size
    if not size:  # nothing to map
        return _chunked_checksum(b"", unmap=None)
    # Hashed from the page cache without a copy (a file just written is still there); each piece's pages are
    # unmapped once hashed, so the process never holds more than a piece (1 MiB) per thread of the file.
    with (
        open(path, "rb") as file,
        mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped,
        memoryview(mapped) as view,
    ):
        return _chunked_checksum(view, unmap=mapped)


def _chunked_checksum(data: Any, unmap: mmap.mmap | None) -> str:
    size = len(data)

    def chunk(index: int) -> bytes:
        # Fed to the hash a mapped piece at a time, each piece's pages unmapped once hashed: a thread holds a piece,
        # not its whole chunk, of the file in memory (the digest is the chunk's all the same).
        digest = hashlib.sha256()
        chunk_end = min((index + 1) * _CHUNK, size)
        for begin in range(index * _CHUNK, chunk_end, _CHECKSUM_PIECE):
            end = min(begin + _CHECKSUM_PIECE, chunk_end)
            digest.update(data[begin:end])
            if unmap is not None and hasattr(mmap, "MADV_DONTNEED") and begin % mmap.PAGESIZE == 0:
                unmap.madvise(mmap.MADV_DONTNEED, begin, end - begin)
        return digest.digest()

    count = max(1, -(-size // _CHUNK))
    with ThreadPoolExecutor(min(count, usable_cpus(), 8)) as pool:
        digests = list(pool.map(chunk, range(count)))
    return hashlib.sha256(b"".join(digests)).hexdigest()


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's share, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity on this platform
        return os.cpu_count() or 1


class NonFiniteError(CheckpointError):
    """A tensor to save holds nan or inf: the checkpoint is not written."""


# ---------------------------------------------------------------------------------------------------------------------
# Finding and pruning


def _step_directories(root: Path) -> list[tuple[int, Path]]:
    """`step_<N>` checkpoints (with their metadata) under `root`, oldest first (unverified)."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIRECTORY.fullmatch(path.name)
        if match and (path / METADATA_FILE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(root: str | Path, *, report: Callable[[str], None] | None = None) -> Path | None:
    """The newest valid `step_<N>` checkpoint under `root` (highest N), or None. A newer one that fails
    `verify_checkpoint` (corrupted, truncated, edited, incomplete) is skipped, and `report` told which and why."""
    for _, path in reversed(_step_directories(Path(root))):
        try:
            verify_checkpoint(path)
        except CheckpointError as error:
            if report is not None:
                report(f"skipped checkpoint {path}: {error}")
            continue
        return path
    return None


def verify_checkpoint(directory: str | Path) -> None:
    """Raise a `CheckpointError` naming the file at fault unless `directory` is a complete checkpoint: its metadata
    valid, every file it lists there and matching its checksum (when recorded), its tensor files readable."""
    directory = Path(directory)
    metadata = _read_metadata(directory)
    _read_yaml(directory / CONFIG_FILE)
    for file in metadata["files"]:
        _verify_checksum(directory / file, metadata)
        if file.endswith(".safetensors"):
            with _TensorFile(directory / file, metadata):
                pass


def keep_last(root: str | Path, count: int) -> list[Path]:
    """Remove all but the `count` latest `step_<N>` checkpoints under `root` (call on one rank); returns the removed.

    Each is renamed `.step_<N>.deleting` before it is removed, so an interrupted pruning never leaves a directory
    that looks like a checkpoint; what earlier interrupted saves and prunings left (`.*.partial`, `.*.deleting`,
    `.*.previous`) is removed too."""
    if count < 1:
        raise ValueError(f"keep_last: count must be >= 1, got {count}")
    root = Path(root)
    removed = [path for _, path in _step_directories(root)[:-count]]
    for path in removed:
        _remove(path)
    for leftover in root.glob(".step_*"):
        if leftover.is_dir() and leftover.suffix in (".partial", ".deleting", ".previous"):
            shutil.rmtree(leftover, ignore_errors=True)
    return removed


def _remove(path: Path) -> None:
    """Remove a checkpoint directory: first renamed (atomic) out of the `step_<N>` names, then deleted."""
    doomed = path.parent / f".{path.name}.deleting"
    if doomed.exists():
        shutil.rmtree(doomed)
    path.rename(doomed)
    _fsync(path.parent)
    shutil.rmtree(doomed)


# ---------------------------------------------------------------------------------------------------------------------
# Loading


def read_checkpoint_config(directory: str | Path) -> dict[str, Any]:
    """The run config of a checkpoint as plain data (structure it with `RunConfig`, overrides as an update)."""
    directory = Path(directory)
    _read_metadata(directory)
    return _read_yaml(directory / CONFIG_FILE)


def read_checkpoint_metadata(directory: str | Path) -> dict[str, Any]:
    """The metadata of a checkpoint (verified: its version, plugins, files, config checksum)."""
    return _read_metadata(Path(directory))


def weights_checksums(directory: str | Path) -> dict[str, str]:
    """{weights file: checksum} of a native checkpoint: the one its metadata records (computed for a checkpoint
    older than the checksums). A checkpoint holding adapters only is no base for another (it has no base weights)."""
    directory = Path(directory)
    metadata = _read_metadata(directory)
    if metadata.get("base"):
        raise CheckpointError(
            directory,
            f"holds PEFT adapters only (its base is {metadata['base'].get('path')!r}), so it cannot be the base of "
            "another checkpoint; write the fine-tuned model whole first: blockzoo convert "
            f"{directory} DESTINATION --merged",
        )
    recorded = (metadata.get("checksums") or {}).get("files", {}).get(MODEL_FILE)
    return {MODEL_FILE: recorded or file_checksum(directory / MODEL_FILE)}


def read_origin(directory: str | Path) -> Origin | None:
    """The origin files a checkpoint keeps (None when its model was not imported from another format)."""
    directory = Path(directory)
    prefix = f"{ORIGIN_DIRECTORY}/"
    names = [file.removeprefix(prefix) for file in _read_metadata(directory)["files"] if file.startswith(prefix)]
    return Origin(directory / ORIGIN_DIRECTORY, tuple(names)) if names else None


def load_checkpoint(
    directory: str | Path,
    *,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    distributed: Distributed,
    model_source: str | None = None,
    base_loaded: bool = False,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read a checkpoint: (config data, metadata), and fill `model`'s parameters and `optimizer`'s state in place.

    Every file read is checked against its checksum in the metadata (when recorded) and every tensor's dtype against
    the parameter's. `model_source` names the model for the message of a tensor whose shape it does not expect (e.g.
    "the model of <checkpoint>/config.yaml", "the model of the run config"; default "the model").

    Every rank calls it and takes its own shards (of the tensor-parallel split, the experts' split over the data
    ranks, and the rows of its FSDP shards), reading one global tensor at a time. Nothing is changed unless every
    tensor is there with its shape. Under pipeline parallelism a stage reads the tensors of its own parameters (the
    others belong to other stages).

    A checkpoint holding adapters only (its metadata has `base`) fills the adapters; the caller must have loaded
    the base weights (`blockzoo.model.factory.load_base`) and pass `base_loaded`.
    """
    directory = Path(directory)
    metadata = _read_metadata(directory)
    config = _read_yaml(directory / CONFIG_FILE)
    if optimizer is not None and model is None:
        raise ValueError("load_checkpoint: loading optimizer state needs the model (its parameter names)")
    if optimizer is not None and OPTIMIZER_FILE not in metadata["files"]:
        raise CheckpointError(directory / OPTIMIZER_FILE, "this checkpoint was saved without optimizer state")
    source = model_source or "the model"
    adapters_only = bool(metadata.get("base"))
    if model is not None and adapters_only and not base_loaded:
        raise CheckpointError(
            directory,
            f"holds PEFT adapters only (its base is {metadata['base'].get('path')!r}): load it with blockzoo.load, "
            "which loads the base first",
        )
    if model is not None:
        parameters = _saved_parameters(model, adapters_only)
        from blockzoo.peft.lora import renamed_adapter_parameters

        renamed = renamed_adapter_parameters(model)  # adapters of fused linears once named by index
        with _TensorFile(directory / MODEL_FILE, metadata, renamed) as weights:
            _check_weights(weights, parameters, source, whole_model=distributed.config.pipeline_parallel == 1)
            if optimizer is not None:  # Read (and checked) before any parameter changes.
                with _TensorFile(directory / OPTIMIZER_FILE, metadata, renamed) as states:
                    optimizer_state = _read_optimizer_state(states, model, optimizer, distributed)
            # Resuming (with the optimizer) copies: a run prunes its old checkpoints, and a file mapped by the model
            # would keep its disk space until the process ends.
            _copy_weights(weights, parameters, distributed, adopt=optimizer is None)
        if optimizer is not None:
            # Through `load_state_dict`: torch places each state tensor (device, dtype) as the optimizer expects.
            state_dict = optimizer.state_dict()
            state_dict["state"] = optimizer_state
            optimizer.load_state_dict(state_dict)
    return config, metadata


def _read_metadata(directory: Path) -> dict[str, Any]:
    if not directory.is_dir():
        raise CheckpointError(directory, "no such checkpoint directory")
    path = directory / METADATA_FILE
    metadata = _read_yaml(path)
    required = {"format_version": int, "blockzoo_version": str, "step": int, "plugins": dict, "files": list}
    for key, kind in required.items():
        if not isinstance(metadata.get(key), kind):
            raise CheckpointError(path, f"`{key}` is missing or not a {kind.__name__}: {metadata.get(key)!r}")
    if not 1 <= metadata["format_version"] <= FORMAT_VERSION:
        raise CheckpointError(
            path,
            f"checkpoint format version {metadata['format_version']} is unknown to blockzoo {__version__} (it reads "
            f"format {FORMAT_VERSION} and older); a newer blockzoo may read it",
        )
    try:
        written_by = Version(metadata["blockzoo_version"])
    except InvalidVersion:
        raise CheckpointError(
            path, f"unknown blockzoo version {metadata['blockzoo_version']!r} (not a version number)"
        ) from None
    if written_by.major > Version(__version__).major:
        raise CheckpointError(
            path,
            f"written by blockzoo {written_by}, a newer major version than this blockzoo {__version__}; "
            "upgrade blockzoo to load it",
        )
    _check_plugins(path, metadata["plugins"])
    for file in metadata["files"]:
        if not (directory / file).is_file():
            raise CheckpointError(directory / file, "missing: the checkpoint lists it but the file is not there")
    _check_checksums_entry(path, metadata)
    _verify_checksum(directory / CONFIG_FILE, metadata)  # small: always (load, generate and resume refuse edits)
    return metadata


def _check_checksums_entry(path: Path, metadata: Mapping[str, Any]) -> None:
    """`checksums` (absent in checkpoints written before it) is {algorithm, files: {file: hex digest}}."""
    if "checksums" not in metadata:
        return
    checksums = metadata["checksums"]
    if not isinstance(checksums, dict) or not isinstance(checksums.get("files"), dict):
        raise CheckpointError(path, f"`checksums` is not a mapping with `algorithm` and `files`: {checksums!r}")
    if checksums.get("algorithm") != CHECKSUM_ALGORITHM:
        raise CheckpointError(
            path,
            f"unknown checksum algorithm {checksums.get('algorithm')!r} (this blockzoo knows {CHECKSUM_ALGORITHM})",
        )


# libyaml's safe loader where PyYAML has it (ten times faster: a checkpoint's YAML files are read a few times a load).
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

# (path, size, modification time, checksum) of files verified by this process: resuming verifies, then loads.
_verified: set[tuple[Path, int, int, str]] = set()


def _verify_checksum(path: Path, metadata: Mapping[str, Any], data: torch.Tensor | None = None) -> None:
    """Raise unless `path` matches the checksum the metadata records for it (nothing recorded: nothing checked).
    `data`: the file's bytes already mapped (`file_checksum`)."""
    name = f"{ORIGIN_DIRECTORY}/{path.name}" if path.parent.name == ORIGIN_DIRECTORY else path.name
    expected = (metadata.get("checksums") or {}).get("files", {}).get(name)
    if expected is None:
        return
    if not path.is_file():
        raise CheckpointError(path, "missing: not a complete checkpoint")
    status = path.stat()
    key = (path.resolve(), status.st_size, status.st_mtime_ns, expected)
    if key in _verified:
        return
    if file_checksum(path, data) != expected:
        if path.name == CONFIG_FILE:
            problem = (
                "edited since the checkpoint was saved (its checksum differs from the one metadata.yaml records); a "
                "checkpoint's config is not to be edited: give changes as overrides of the run config instead"
            )
        else:
            problem = (
                "corrupted or rewritten since the checkpoint was saved (its checksum differs from the one "
                "metadata.yaml records)"
            )
        raise CheckpointError(path, problem)
    _verified.add(key)


def _check_plugins(path: Path, plugins: Mapping[str, Any]) -> None:
    """Every plugin the checkpoint's config needs is installed and loaded."""
    installed = get_registry().plugins.values()
    records = {record.name: record for record in installed if record.status == "loaded"}
    failed = {record.name: record for record in installed if record.status != "loaded"}
    for name, needed in plugins.items():
        if name in records:
            continue
        needed = needed if isinstance(needed, Mapping) else {}
        described = f"plugin {name!r}"
        if needed.get("distribution"):
            described += f" ({needed['distribution']} {needed.get('version')})"
        types = ", ".join(needed.get("types") or ())
        if name in failed:
            record = failed[name]
            reason = f"is installed but {record.status}: {record.error}"
        else:
            reason = "is not installed"
        raise CheckpointError(path, f"the checkpoint needs {described}, which {reason} (it provides: {types})")


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(path, "missing: not a complete checkpoint")
    try:
        data = yaml.load(path.read_text(), Loader=_YAML_LOADER)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise CheckpointError(path, f"cannot be read: {error}") from None
    if not isinstance(data, dict):
        raise CheckpointError(path, f"expected a mapping, found {type(data).__name__}")
    return data


class _TensorFile:
    """A safetensors file read tensor by tensor as views of its memory map (`SafetensorsReader.mapped`), with errors
    that name it, checked against the checksum `metadata` records for it (hashed over the same map: the pages it
    reads are those the tensors then use). Use as a context manager."""

    def __init__(self, path: Path, metadata: Mapping[str, Any], renamed: Mapping[str, str] | None = None):
        self.path = path
        if not path.is_file():
            raise CheckpointError(path, "missing: not a complete checkpoint")
        try:
            self._reader = SafetensorsReader(path)
        except ConversionError as error:
            problem = str(error).removeprefix(f"{path}: ")
            raise CheckpointError(
                path,
                f"not a readable safetensors file ({problem}): corrupted or rewritten since the checkpoint was saved",
            ) from None
        try:
            _verify_checksum(path, metadata, self._reader.mapped_file())
        except BaseException:
            self._reader.close()
            raise
        # `renamed`: {parameter name before, now}: a tensor saved under a parameter's former name (or its optimizer
        # state, `<name>/<key>`) is read as the parameter's present one.
        parameters_saved = {name.partition("/")[0] for name in self._reader.names}
        self._file_names = {}
        for name in self._reader.names:
            head, slash, rest = name.partition("/")
            new = (renamed or {}).get(head)
            self._file_names[new + slash + rest if new and new not in parameters_saved else name] = name
        self.shapes = {name: self._reader.shape(saved) for name, saved in self._file_names.items()}
        self.dtypes = {name: self._reader.dtype(saved) for name, saved in self._file_names.items()}

    def __enter__(self) -> _TensorFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._reader.close()

    def get(self, name: str) -> torch.Tensor:
        """The tensor, a view of the mapped file (private: writing to it never changes the file)."""
        return self._reader.mapped(self._file_names.get(name, name))

    def error(self, problem: str) -> CheckpointError:
        return CheckpointError(self.path, problem)


def _global_shape(parameter: nn.Parameter) -> tuple[int, ...]:
    meta = getattr(parameter, "meta", None)
    return tuple(parameter.shape) if meta is None else meta.global_shape


def _to_local(tensor: torch.Tensor, parameter: nn.Parameter, distributed: Distributed) -> torch.Tensor:
    """This rank's part of a global tensor shaped like `parameter`: its tensor-parallel (and expert-parallel) shard,
    laid out as the parameter (an FSDP DTensor holding this rank's rows of it). A copy: a view would keep the whole
    global tensor alive."""
    meta = getattr(parameter, "meta", None)
    if meta is not None:
        tensor = meta.global_to_local(
            tensor, distributed.tensor_rank, distributed.tensor_size, distributed.data_rank, distributed.data_size
        )
    return shard_like(parameter, tensor).clone()


def _check_weights(
    file: _TensorFile, parameters: Mapping[str, nn.Parameter], source: str, *, whole_model: bool = True
) -> None:
    """Every parameter (of the model built from `source`) is in the file with its global shape and dtype, and (for a
    `whole_model`, not a pipeline stage) nothing else is."""
    if missing := [name for name in parameters if name not in file.shapes]:
        more = f" (and {len(missing) - 1} more: {', '.join(missing[1:])})" if len(missing) > 1 else ""
        raise file.error(f"tensor {missing[0]!r} is missing{more}")
    if whole_model and (unexpected := sorted(set(file.shapes) - set(parameters))):
        raise file.error(f"the model has no parameter {', '.join(map(repr, unexpected))} that the file holds")
    for name, parameter in parameters.items():
        if (shape := file.shapes[name]) != (expected := _global_shape(parameter)):
            raise file.error(
                f"tensor {name!r} has shape {list(shape)}, but {source} expects {list(expected)}: the two disagree (an "
                "architecture field changed?)"
            )
        if file.dtypes[name] != parameter.dtype:
            raise file.error(
                f"tensor {name!r} is {file.dtypes[name]}, but {parameter.dtype} was saved (and is expected)"
            )


def _copy_weights(
    file: _TensorFile, parameters: Mapping[str, nn.Parameter], distributed: Distributed, *, adopt: bool
) -> None:
    """Fill the parameters; with `adopt`, one held whole here becomes the mapped tensor (`blockzoo.loading`)."""
    with torch.no_grad():
        for name, parameter in parameters.items():
            fill_parameter(parameter, file.get(name), distributed, adopt=adopt)


def _read_optimizer_state(
    file: _TensorFile, model: nn.Module, optimizer: torch.optim.Optimizer, distributed: Distributed
) -> dict[int, dict[str, torch.Tensor]]:
    """The optimizer's `state_dict()["state"]`: this rank's shards, by the parameters' indices in the optimizer."""
    parameters = dict(model.named_parameters())
    optimized = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    index_of = {id(parameter): index for index, parameter in enumerate(optimized)}
    keys: dict[str, set[str]] = {}
    for tensor_name, shape in file.shapes.items():
        name, _, key = tensor_name.partition("/")
        if name not in parameters and distributed.config.pipeline_parallel > 1:
            continue  # another stage's
        if name not in parameters:
            raise file.error(f"optimizer state {tensor_name!r} is for {name!r}, which is not a parameter of the model")
        if id(parameters[name]) not in index_of:
            raise file.error(f"optimizer state {tensor_name!r} is for {name!r}, which this optimizer does not train")
        if shape not in ((), _global_shape(parameters[name])):
            raise file.error(
                f"tensor {tensor_name!r} has shape {list(shape)}, expected [] or the parameter's "
                f"{list(_global_shape(parameters[name]))}"
            )
        keys.setdefault(name, set()).add(key)
    if len({frozenset(found) for found in keys.values()}) > 1:
        expected = set.union(*keys.values())
        name, found = next((name, found) for name, found in keys.items() if found != expected)
        missing = ", ".join(f"{name}/{key}" for key in sorted(expected - found))
        raise file.error(f"tensor {missing} is missing (the other parameters have {', '.join(sorted(expected))})")
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, state_keys in keys.items():
        parameter = parameters[name]
        own = state.setdefault(index_of[id(parameter)], {})
        for key in sorted(state_keys):
            tensor = file.get(f"{name}/{key}")
            own[key] = _to_local(tensor, parameter, distributed) if tensor.ndim else tensor.clone()
    return state
