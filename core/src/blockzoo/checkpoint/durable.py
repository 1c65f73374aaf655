"""Durable file-system steps: fsync, the atomic replacement of a directory, a free name beside a path."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def free_name(path: Path) -> Path:
    """`path`, or `path.1`, `path.2`, ...: the first that does not exist."""
    candidate, number = path, 0
    while candidate.exists():
        number += 1
        candidate = path.with_name(f"{path.name}.{number}")
    return candidate


def replace_directory(source: Path, target: Path) -> None:
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


def fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
