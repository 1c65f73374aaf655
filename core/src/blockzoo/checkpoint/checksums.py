"""The checksums `metadata.yaml` records of a checkpoint's files: computed by several threads at once over the
file's memory map, and verified once per file version by a process."""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from blockzoo.checkpoint.format import CONFIG_FILE, ORIGIN_DIRECTORY, CheckpointError

# The SHA-256 of the concatenated SHA-256 digests of the file's 16 MiB chunks: hashed by several threads at once
# (hashlib releases the GIL), about 0.25 s for 500 MB on 2 cores.
CHECKSUM_ALGORITHM = "sha256-16MiB-chunks"


_CHUNK = 16 * 2**20


_CHECKSUM_PIECE = 2**20  # a multiple of the page size: each piece's pages are unmapped once hashed


# (path, size, modification time, checksum) of files verified by this process: resuming verifies, then loads.
_verified: set[tuple[Path, int, int, str]] = set()


def verify_checksum(path: Path, metadata: Mapping[str, Any], data: torch.Tensor | None = None) -> None:
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
