"""Reading and writing safetensors files one tensor at a time, with plain file reads and writes.

The format: an 8-byte little-endian header length, a JSON header `{name: {dtype, shape, data_offsets}, "__metadata__":
{...}}`, then the tensors' bytes. Not memory-mapped: a tensor read is a copy of its bytes and nothing else stays
resident, so converting a checkpoint holds about one shard in memory, however large the files. Every problem
(truncated file, corrupted header) is a `ConversionError` naming the file.

One copy for the project: native checkpoints (`blockzoo.checkpoint`) are written with `SafetensorsWriter` tensor by
tensor as the ranks gather them, and the Hugging Face converter reads and writes its files with both classes.
"""

from __future__ import annotations

import errno
import json
import math
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from blockzoo.conversion import ConversionError

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_HEADER_LIMIT = 100_000_000  # safetensors' own limit on the header size


class SafetensorsReader:
    """The tensors of one safetensors file, read on demand. Use as a context manager."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self._file = open(self.path, "rb")  # noqa: SIM115 - closed by close() / the context manager
        except FileNotFoundError:
            raise ConversionError(f"{self.path}: missing") from None
        except OSError as error:
            raise ConversionError(f"{self.path}: cannot be opened: {error}") from None
        try:
            self.entries, self.metadata = self._read_header()
        except BaseException:
            self._file.close()
            raise

    def _read_header(self) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        size = os.fstat(self._file.fileno()).st_size
        prefix = self._file.read(8)
        if len(prefix) < 8:
            raise self._error(f"truncated: {size} bytes, not even a header")
        (header_size,) = struct.unpack("<Q", prefix)
        if header_size > min(_HEADER_LIMIT, size - 8):
            raise self._error(f"corrupted or truncated: a header of {header_size} bytes in a file of {size}")
        try:
            header = json.loads(self._file.read(header_size))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise self._error(f"corrupted header: {error}") from None
        if not isinstance(header, dict):
            raise self._error("corrupted header: not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + header_size
        data_size = size - self._data_start
        for name, entry in header.items():
            try:
                dtype, shape, (begin, end) = DTYPES[entry["dtype"]], entry["shape"], entry["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise self._error(f"corrupted header entry for tensor {name!r}: {entry!r}") from None
            if end - begin != math.prod(shape) * dtype.itemsize or begin < 0:
                raise self._error(f"corrupted header: tensor {name!r} has offsets {begin}..{end} for shape {shape}")
            if end > data_size:
                raise self._error(
                    f"truncated: tensor {name!r} needs bytes up to {self._data_start + end}, the file has {size}"
                )
        return header, metadata

    def _error(self, problem: str) -> ConversionError:
        return ConversionError(f"{self.path}: {problem}")

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    @property
    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[self.entries[name]["dtype"]]

    def read(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        begin, end = entry["data_offsets"]
        dtype, shape = DTYPES[entry["dtype"]], entry["shape"]
        tensor = torch.empty(shape, dtype=dtype)
        self._file.seek(self._data_start + begin)
        if self._file.readinto(tensor.reshape(-1).view(torch.uint8).numpy()) != end - begin:
            raise self._error(f"truncated while reading tensor {name!r}")
        return tensor


class SafetensorsWriter:
    """Writes a safetensors file whose tensors (names, dtypes, shapes) are known up front, in any order.

    The header is written first and the file sized; each `write` puts a tensor at its place. Use as a context
    manager: leaving it checks that every tensor of `writes` (default: all) was written (unless an error is on its
    way out). With `create=False` the file, made by another writer of the same `tensors` and `metadata` (another
    process), is opened to write `writes` into it: several processes fill one file, each its own tensors.
    """

    def __init__(
        self,
        path: Path,
        tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
        metadata: Mapping[str, str] | None = None,
        *,
        create: bool = True,
        writes: Iterable[str] | None = None,
    ):
        self.path = Path(path)
        self._layout: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {}
        header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        for name, (dtype, shape) in tensors.items():
            size = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            self._layout[name] = (offset, dtype, tuple(shape))
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
        self._data_start = 8 + len(encoded)
        self._remaining = set(self._layout if writes is None else writes)
        if unknown := self._remaining - set(self._layout):
            raise ValueError(f"{self.path}: tensors to write that the file does not hold: {', '.join(sorted(unknown))}")
        if create:
            self._file = open(self.path, "wb")  # noqa: SIM115 - closed by __exit__
            try:
                self._file.write(struct.pack("<Q", len(encoded)) + encoded)
                self._file.flush()
                _allocate(self._file.fileno(), self._data_start + offset)
            except BaseException:
                self._file.close()
                raise
        else:
            self._file = open(self.path, "r+b")  # noqa: SIM115 - closed by __exit__

    @property
    def size(self) -> int:
        """Bytes of tensor data."""
        return sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in self._layout.values())

    def write(self, name: str, tensor: torch.Tensor) -> None:
        offset, dtype, shape = self._layout[name]
        if tuple(tensor.shape) != shape:
            raise ConversionError(
                f"{self.path}: tensor {name!r} has shape {list(tensor.shape)}, expected {list(shape)}"
            )
        data = tensor.detach().to(device="cpu", dtype=dtype).contiguous().reshape(-1).view(torch.uint8)
        self._file.seek(self._data_start + offset)
        self._file.write(data.numpy().data)
        self._remaining.discard(name)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, error_type: type | None, *_: object) -> None:
        self.close(complete=error_type is None)

    def close(self, *, complete: bool = True) -> None:
        """Close the file; when `complete`, first check that every tensor was written and flush it to the disk."""
        try:
            if complete:
                if self._remaining:
                    raise ConversionError(f"{self.path}: tensors never written: {', '.join(sorted(self._remaining))}")
                self._file.flush()
                os.fsync(self._file.fileno())
        finally:
            self._file.close()


def _allocate(descriptor: int, size: int) -> None:
    """Size the file to `size` bytes, its blocks reserved where the file system can (so that a full disk fails here,
    with ENOSPC, rather than in the middle of the tensors); elsewhere a sparse file."""
    try:
        os.posix_fallocate(descriptor, 0, size)
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise
        os.ftruncate(descriptor, size)  # no fallocate here (EOPNOTSUPP, EINVAL): blocks come with the writes
    except AttributeError:  # not on this platform
        os.ftruncate(descriptor, size)
