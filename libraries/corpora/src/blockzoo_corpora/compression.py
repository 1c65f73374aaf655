"""`.zst` line files, decompressed as a stream (memory does not grow with the file)."""

from __future__ import annotations

import io
from typing import IO


def open_zstd(raw: IO[bytes]) -> IO[bytes]:
    import zstandard

    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw))
