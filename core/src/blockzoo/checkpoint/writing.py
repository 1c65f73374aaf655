"""Saving a checkpoint: the files made in a temporary directory beside the target, the tensors streamed into them
(`gather`), the YAML files and checksums written last, everything synced, then the directory renamed into place."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from blockzoo import __version__
from blockzoo.checkpoint.checksums import CHECKSUM_ALGORITHM, file_checksum
from blockzoo.checkpoint.durable import free_name, fsync, replace_directory
from blockzoo.checkpoint.format import (
    CONFIG_FILE,
    FORMAT_VERSION,
    METADATA_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    ORIGIN_DIRECTORY,
    STEP_DIRECTORY,
    CheckpointError,
    read_yaml,
    yaml_text,
)
from blockzoo.checkpoint.gather import agree, file_layout, optimizer_state_of, stream_tensors, weights_of
from blockzoo.checkpoint.origin import copy_origin
from blockzoo.checkpoint.plugin_versions import plugins_used
from blockzoo.checkpoint.space import make_room, space_needed
from blockzoo.config import Config, to_yaml
from blockzoo.conversion import Origin
from blockzoo.distributed.runtime import Distributed


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
        "plugins": plugins_used(run_config),
        "data": dict(data_state or {}),
        "extra": dict(extra or {}),
        "files": files,
    }
    if base is not None:
        metadata["base"] = dict(base)
    # Checked on every rank before any collective, so that bad trainer state fails everywhere alike.
    yaml_text(metadata, "the checkpoint metadata (data_state, extra)")
    config = to_yaml(run_config)
    tensors = {MODEL_FILE: dict(weights_of(model, adapters_only=base is not None))}
    if optimizer is not None:
        tensors[OPTIMIZER_FILE] = dict(optimizer_state_of(directory, model, optimizer))
    layouts = {file: file_layout(entries, distributed) for file, entries in tensors.items()}
    needed = space_needed(layouts, config, origin)
    temporary = directory.parent / f".{directory.name}.partial"
    failure: BaseException | None = None
    if distributed.rank == 0:
        try:
            _prepare(directory, temporary, needed=needed, keep=keep, log=log)
        except BaseException as error:  # noqa: BLE001 - the other ranks must hear of it before it is raised
            failure = error
    agree(distributed, failure, directory, needed=needed)
    failure = stream_tensors(directory, temporary, tensors, layouts, distributed)
    agree(distributed, failure, directory, cleanup=temporary, needed=needed)
    if distributed.rank == 0:
        try:
            _finish(directory, temporary, config=config, metadata=metadata, origin=origin)
        except BaseException as error:  # noqa: BLE001
            failure = error
    agree(distributed, failure, directory, cleanup=temporary, needed=needed)
    return directory


def _prepare(directory: Path, temporary: Path, *, needed: int, keep: int | None, log: Callable[[str], None]) -> None:
    if directory.exists() and not (directory / METADATA_FILE).is_file() and any(directory.iterdir()):
        if not STEP_DIRECTORY.fullmatch(directory.name):
            raise CheckpointError(directory, "exists and is not a checkpoint; refusing to replace it")
        # A run's own step directory (an interrupted save, a hand edit): kept, but out of the way.
        aside = free_name(directory.parent / f"{directory.name}.not-a-checkpoint")
        directory.rename(aside)
        log(f"{directory} exists and is not a checkpoint (no {METADATA_FILE}): moved it aside to {aside}")
    directory.parent.mkdir(parents=True, exist_ok=True)
    if temporary.exists():  # Left by a save that crashed.
        shutil.rmtree(temporary)
    make_room(directory, needed, keep, log)
    temporary.mkdir()


def _finish(
    directory: Path, temporary: Path, *, config: str, metadata: Mapping[str, Any], origin: Origin | None
) -> None:
    """Complete the checkpoint whose tensor files are written in `temporary` (its checksums in the metadata, written
    last), then put it at `directory`."""
    try:
        (temporary / CONFIG_FILE).write_text(config)
        if origin is not None:
            copy_origin(origin, temporary / ORIGIN_DIRECTORY)
        checked = [CONFIG_FILE, *metadata["files"]]
        checksums = {file: file_checksum(temporary / file) for file in checked}
        metadata = {**metadata, "checksums": {"algorithm": CHECKSUM_ALGORITHM, "files": checksums}}
        (temporary / METADATA_FILE).write_text(yaml_text(metadata, "the checkpoint metadata"))
        for path in temporary.rglob("*"):
            fsync(path)
        replace_directory(temporary, directory)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    fsync(directory.parent)


def record_checksum(directory: Path, file: str) -> None:
    """Record the checksum of `file` of the checkpoint at `directory` anew, for a file written after the checkpoint
    (a converter that streams the weights into a checkpoint saved without them). The metadata is replaced
    atomically."""
    metadata = read_yaml(directory / METADATA_FILE)
    checksums = metadata.get("checksums")
    if not isinstance(checksums, dict) or file not in checksums.get("files", {}):
        raise CheckpointError(directory / METADATA_FILE, f"records no checksum of {file} to update")
    checksums["files"][file] = file_checksum(directory / file, algorithm=checksums["algorithm"])
    temporary = directory / f".{METADATA_FILE}.new"
    temporary.write_text(yaml_text(metadata, "the checkpoint metadata"))
    fsync(temporary)
    temporary.replace(directory / METADATA_FILE)
