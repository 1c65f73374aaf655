"""The checksums `metadata.yaml` records of a checkpoint's files: hashed over the file's memory map, and verified
once per file version by a process."""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import xxhash

from blockzoo.checkpoint.format import CONFIG_FILE, ORIGIN_DIRECTORY, CheckpointError

# What this blockzoo writes: XXH3's 128-bit hash of the file (xxhash), about 18 GB/s a core, so that hashing costs a
# save or a cold load a tenth of a second where SHA-256 cost two. It detects corruption (bit flips, torn or truncated
# writes, a file swapped for another), which is its job; it resists no forger, but neither would a digest stored
# beside the file it checks.
CHECKSUM_ALGORITHM = "xxh3-128"
# What earlier checkpoints record, still verified: the SHA-256 of the concatenated SHA-256 digests of the file's
# 16 MiB chunks (hashed by several threads at once).
SHA256_CHUNKS = "sha256-16MiB-chunks"


_CHUNK = 16 * 2**20  # the SHA-256 scheme's chunks


_PIECE = 2**20  # a multiple of the page size: each piece's pages are unmapped once hashed


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
    if file_checksum(path, data, metadata["checksums"]["algorithm"]) != expected:
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


def file_checksum(path: Path, data: torch.Tensor | None = None, algorithm: str = CHECKSUM_ALGORITHM) -> str:
    """The file's checksum by `algorithm` (one of `CHECKSUM_ALGORITHMS`). `data`: the file's bytes as a mapped uint8
    tensor (`SafetensorsReader.mapped_file`), hashed where they are (no copy; a loader's tensors are views of the same
    map), else the file is mapped here for the hashing."""
    checksum = CHECKSUM_ALGORITHMS[algorithm]
    if data is not None:
        return checksum(data.numpy() if len(data) else b"", None)
    if not path.stat().st_size:  # nothing to map
        return checksum(b"", None)
    # Hashed from the page cache without a copy (a file just written is still there); each piece's pages are
    # unmapped once hashed, so the process never holds more than a piece (1 MiB) per thread of the file.
    with (
        open(path, "rb") as file,
        mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped,
        memoryview(mapped) as view,
    ):
        return checksum(view, mapped)


def _pieces(data: Any, begin: int, end: int, unmap: mmap.mmap | None) -> Iterator[Any]:
    """`data[begin:end]` a piece at a time, each piece's pages unmapped (from `unmap`) once the caller hashed it."""
    for start in range(begin, end, _PIECE):
        stop = min(start + _PIECE, end)
        yield data[start:stop]
        if unmap is not None and hasattr(mmap, "MADV_DONTNEED") and start % mmap.PAGESIZE == 0:
            unmap.madvise(mmap.MADV_DONTNEED, start, stop - start)


def _xxh3_128(data: Any, unmap: mmap.mmap | None) -> str:
    digest = xxhash.xxh3_128()
    for piece in _pieces(data, 0, len(data), unmap):
        digest.update(piece)
    return digest.hexdigest()


def _sha256_chunks(data: Any, unmap: mmap.mmap | None) -> str:
    size = len(data)

    def chunk(index: int) -> bytes:
        digest = hashlib.sha256()
        for piece in _pieces(data, index * _CHUNK, min((index + 1) * _CHUNK, size), unmap):
            digest.update(piece)
        return digest.digest()

    count = max(1, -(-size // _CHUNK))
    with ThreadPoolExecutor(min(count, usable_cpus(), 8)) as pool:  # hashlib releases the GIL
        digests = list(pool.map(chunk, range(count)))
    return hashlib.sha256(b"".join(digests)).hexdigest()


# Every algorithm this blockzoo verifies: (the bytes, a map to unmap them from as they are hashed) -> hex digest.
CHECKSUM_ALGORITHMS: dict[str, Callable[[Any, mmap.mmap | None], str]] = {
    CHECKSUM_ALGORITHM: _xxh3_128,
    SHA256_CHUNKS: _sha256_chunks,
}


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's share, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity on this platform
        return os.cpu_count() or 1
