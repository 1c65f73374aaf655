"""Reading and writing safetensors files one tensor at a time.

The format: an 8-byte little-endian header length, a JSON header `{name: {dtype, shape, data_offsets}, "__metadata__":
{...}}`, then the tensors' bytes. Every problem (truncated file, corrupted header) is a `ConversionError` naming the
file. Two ways to read a tensor:

- `read`: a plain file read into a new tensor, nothing else stays resident (converting a checkpoint holds about one
  shard in memory, however large the files);
- `mapped`: a view of the file mapped in memory, private (copy-on-write: writing to it changes this process's
  memory, never the file). Nothing is read until the view is used, and then from the page cache without a copy, so
  a loaded model's parameters can be the file's pages themselves (`blockzoo.load`, as transformers does), or a copy
  from them into a parameter (a shard, a dtype cast, a concatenated weight's part) is the only pass over the bytes.

One copy for the project: native checkpoints (`blockzoo.checkpoint`) are written with `SafetensorsWriter` tensor by
tensor as the ranks gather them, and the Hugging Face converter reads and writes its files with both classes.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import json
import math
import mmap
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
        self._map: torch.Tensor | None = None  # the whole file, mapped on first use (`mapped`)
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
        """Close the file; the views `mapped` gave stay valid (the mapping lives as long as one of them)."""
        self._file.close()
        self._map = None

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

    def mapped(self, name: str) -> torch.Tensor:
        """The tensor `name` as a view of the file mapped in memory (private, copy-on-write; see the module)."""
        begin, end = self.entries[name]["data_offsets"]
        return self._view(begin, end, self.dtype(name), self.shape(name))

    def mapped_run(self, names: list[str]) -> torch.Tensor | None:
        """The tensors `names` laid end to end along their first dim, as one mapped view, when the file holds them
        so: each right after the previous one, of one dtype and the same other dims. Else None."""
        entries = [self.entries[name] for name in names]
        dtypes = {entry["dtype"] for entry in entries}
        trailing = {tuple(entry["shape"][1:]) for entry in entries}
        if len(dtypes) != 1 or len(trailing) != 1 or any(not entry["shape"] for entry in entries):
            return None
        if any(a["data_offsets"][1] != b["data_offsets"][0] for a, b in itertools.pairwise(entries)):
            return None
        rows = sum(entry["shape"][0] for entry in entries)
        begin, end = entries[0]["data_offsets"][0], entries[-1]["data_offsets"][1]
        return self._view(begin, end, DTYPES[dtypes.pop()], (rows, *trailing.pop()))

    def mapped_file(self) -> torch.Tensor:
        """The whole file's bytes (header included) as a uint8 tensor of the map the `mapped` views share."""
        if self._map is None:
            # ACCESS_COPY: a private mapping, so the tensors are writable and no write reaches the file.
            self._map = torch.frombuffer(mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_COPY), dtype=torch.uint8)
        return self._map

    def _view(self, begin: int, end: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        if begin == end:  # an empty tensor (no bytes to map)
            return torch.empty(shape, dtype=dtype)
        data = self.mapped_file()[self._data_start + begin : self._data_start + end]
        if (self._data_start + begin) % dtype.itemsize:  # not aligned for a view as `dtype` (never in our files)
            data = data.clone()
        return data.view(dtype).reshape(shape)


class SafetensorsWriter:
    """Writes a safetensors file whose tensors (names, dtypes, shapes) are known up front, in any order.

    The header is written first and the file sized; each `write` puts a tensor at its place. Use as a context
    manager: leaving it checks that every tensor of `writes` (default: all) was written (unless an error is on its
    way out). With `create=False` the file, made by another writer of the same `tensors` and `metadata` (another
    process), is opened to write `writes` into it: several processes fill one file, each its own tensors. With
    `durable=False` the bytes are left in the page cache when the file closes (no fsync, no early writeback): about
    twice as fast on a slow disk, and lost, or torn, if the machine crashes before the kernel writes them.
    """

    def __init__(
        self,
        path: Path,
        tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
        metadata: Mapping[str, str] | None = None,
        *,
        create: bool = True,
        writes: Iterable[str] | None = None,
        durable: bool = True,
    ):
        self.path = Path(path)
        self.durable = durable
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
        # No copy when the tensor is already a contiguous CPU tensor of the file's dtype: written from its memory.
        data = tensor.detach().to(device="cpu", dtype=dtype).contiguous().reshape(-1).view(torch.uint8)
        self._file.seek(self._data_start + offset)
        self._file.write(data.numpy().data)
        self._file.flush()
        # The disk starts writing these bytes now, while the caller prepares the next tensor: the fsync of `close`
        # then waits for the last ones only, not for the whole file (measured: benchmarks/RESULTS.md).
        if self.durable:
            _start_writeback(self._file.fileno(), self._data_start + offset, data.numel())
        self._remaining.discard(name)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, error_type: type | None, *_: object) -> None:
        self.close(complete=error_type is None)

    def close(self, *, complete: bool = True, sync: bool | None = None) -> None:
        """Close the file; when `complete`, first check that every tensor was written and (with `sync`, by default
        when the writer is durable) flush it to the disk. `sync=False` on a durable writer: the caller fsyncs the file
        itself later (and must, before relying on it)."""
        try:
            if complete:
                if self._remaining:
                    raise ConversionError(f"{self.path}: tensors never written: {', '.join(sorted(self._remaining))}")
                self._file.flush()
                if self.durable if sync is None else sync:
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


def _sync_file_range() -> Any:
    """Linux's `sync_file_range` (not in `os`), or None elsewhere."""
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError, TypeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writing the range's dirty pages, without waiting for them


def _start_writeback(descriptor: int, offset: int, size: int) -> None:
    """Ask the kernel to start writing `size` bytes at `offset` to the disk (asynchronously). Only a head start for
    a later fsync, which alone makes them durable: where this is unavailable or fails, nothing changes but speed."""
    if _SYNC_FILE_RANGE is not None and size:
        _SYNC_FILE_RANGE(descriptor, offset, size, _SYNC_FILE_RANGE_WRITE)
