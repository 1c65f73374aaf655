"""Checkpoint directories, read and written one tensor at a time.

- A Hugging Face directory: `config.json`, and `model.safetensors` or shards listed by `model.safetensors.index.json`
  (`weight_map`: tensor name -> shard file). Pickle checkpoints (`pytorch_model.bin`) are never read.
- A native blockzoo checkpoint written without building the model: `config.yaml`, `metadata.yaml`,
  `model.safetensors` (see `blockzoo.checkpoint`).

Directories are written beside their destination under a hidden temporary name and renamed when complete.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from blockzoo.api import Distributed
from blockzoo.checkpoint import MODEL_FILE, record_checksum, save_checkpoint
from blockzoo.config import Config
from blockzoo.conversion import ConversionError, Origin, read_json
from blockzoo.safetensors_io import SafetensorsReader, SafetensorsWriter

CONFIG_JSON = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_METADATA = {"format": "pt"}  # transformers checks it


@attrs.frozen
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype


def huggingface_tensors(directory: Path) -> dict[str, TensorInfo]:
    """Every tensor of a Hugging Face directory: its shard, shape and dtype (headers only; shards checked)."""
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConversionError(f"{index_path}: no `weight_map` of tensor names to files")
        listed: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            listed.setdefault(file, []).append(name)
    elif (directory / SINGLE_FILE).is_file():
        listed = {SINGLE_FILE: []}
    else:
        pickles = sorted(path.name for path in directory.glob("*.bin"))
        found = (
            f" (found {', '.join(pickles)}: pickle checkpoints are not read; save with safetensors)" if pickles else ""
        )
        raise ConversionError(f"{directory}: no {SINGLE_FILE} nor {INDEX_FILE}{found}")
    tensors: dict[str, TensorInfo] = {}
    for file, names in sorted(listed.items()):
        path = directory / file
        if not path.is_file():
            example = f", e.g. {names[0]!r}" if names else ""
            raise ConversionError(f"{path}: missing shard ({INDEX_FILE} lists {len(names)} tensors in it{example})")
        with SafetensorsReader(path) as reader:
            if missing := [name for name in names if name not in reader.entries]:
                raise ConversionError(f"{path}: {INDEX_FILE} lists tensor {missing[0]!r} in it, but it is not there")
            for name in reader.names:
                if name in tensors:
                    raise ConversionError(f"{path}: tensor {name!r} is also in {tensors[name].file.name}")
                tensors[name] = TensorInfo(path, reader.shape(name), reader.dtype(name))
    return tensors


def read_in_file_order(tensors: Mapping[str, TensorInfo], names: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for each of `names`, one file at a time, each file closed before the next is opened."""
    by_file: dict[Path, list[str]] = {}
    for name, info in tensors.items():
        if name in names:
            by_file.setdefault(info.file, []).append(name)
    for file, file_names in sorted(by_file.items()):
        with SafetensorsReader(file) as reader:
            for name in file_names:
                yield name, reader.read(name)


class MappedTensors:
    """The tensors of a directory (`huggingface_tensors`) as views of their memory-mapped shards
    (`SafetensorsReader.mapped`: nothing read until used, writing never reaches the files). Each shard is opened on
    first use and closed with the context; the views stay valid after it."""

    def __init__(self, tensors: Mapping[str, TensorInfo]):
        self._tensors = tensors
        self._readers: dict[Path, SafetensorsReader] = {}

    def __enter__(self) -> MappedTensors:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()

    def _reader(self, name: str) -> SafetensorsReader:
        file = self._tensors[name].file
        if file not in self._readers:
            self._readers[file] = SafetensorsReader(file)
        return self._readers[file]

    def get(self, name: str) -> torch.Tensor:
        return self._reader(name).mapped(name)

    def run(self, names: Sequence[str]) -> torch.Tensor | None:
        """The tensors `names` end to end along dim 0 as one view, when one shard holds them so (else None)."""
        if len({self._tensors[name].file for name in names}) != 1:
            return None
        return self._reader(names[0]).mapped_run(list(names))


# ---------------------------------------------------------------------------------------------------------------------
# Writing directories


def check_new_directory(destination: Path) -> None:
    """Refuse a destination that exists and is not an empty directory: nothing of the user's is replaced."""
    destination = Path(destination)
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())):
        raise ConversionError(f"{destination}: exists and is not empty; choose a new directory")


@contextlib.contextmanager
def new_directory(destination: Path, *, write: bool = True) -> Iterator[Path | None]:
    """A temporary directory beside `destination`, renamed to it when the block completes (removed on error).
    `destination` must not exist or be empty. With `write` false (ranks other than 0), nothing is made."""
    if not write:
        yield None
        return
    destination = Path(destination)
    check_new_directory(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    temporary = destination.parent / f".{destination.name}.partial"
    if temporary.exists():  # left by a conversion that crashed
        shutil.rmtree(temporary)
    temporary.mkdir()
    try:
        yield temporary
        if destination.exists():
            destination.rmdir()
        temporary.rename(destination)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def plan_shards(sizes: Sequence[tuple[Any, int]], max_shard_size: int) -> list[list[Any]]:
    """Groups of consecutive items, each group's bytes at most `max_shard_size` (an item larger than that alone).
    `sizes`: (item, bytes) in writing order."""
    shards: list[list[Any]] = [[]]
    total = 0
    for item, size in sizes:
        if shards[-1] and total + size > max_shard_size:
            shards.append([])
            total = 0
        shards[-1].append(item)
        total += size
    return shards


def shard_names(count: int) -> list[str]:
    """transformers' names: `model.safetensors` alone, else `model-00001-of-00003.safetensors`, ..."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{index:05d}-of-{count:05d}.safetensors" for index in range(1, count + 1)]


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_index(directory: Path, weight_map: Mapping[str, str], total_size: int) -> None:
    write_json(directory / INDEX_FILE, {"metadata": {"total_size": total_size}, "weight_map": dict(weight_map)})


def open_writer(
    path: Path, tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], *, durable: bool = True
) -> SafetensorsWriter:
    return SafetensorsWriter(path, tensors, SAFETENSORS_METADATA, durable=durable)


# ---------------------------------------------------------------------------------------------------------------------
# Native checkpoints


@contextlib.contextmanager
def new_native_checkpoint(
    destination: Path, run_config: Config, *, source: str, origin: Origin | None = None
) -> Iterator[Path]:
    """Yields the path of the `model.safetensors` to write; then `destination` is a native checkpoint at step 0 of
    `run_config` with those weights (and the `origin` files). The core writes config and metadata (of a model
    without parameters here), the weights file then replaces its empty one, and the whole is renamed into place."""
    destination = Path(destination)
    check_new_directory(destination)
    staging = destination.parent / f".{destination.name}.converting"
    if staging.exists():  # left by a conversion that crashed
        shutil.rmtree(staging)
    try:
        save_checkpoint(
            staging,
            model=torch.nn.Module(),
            run_config=run_config,
            step=0,
            distributed=Distributed(run_config.distributed, world_size=1, rank=0),
            extra={"converted_from": source},
            origin=origin,
        )
        yield staging / MODEL_FILE
        record_checksum(staging, MODEL_FILE)  # the metadata was written with the empty weights file
        if destination.exists():
            destination.rmdir()
        staging.rename(destination)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
