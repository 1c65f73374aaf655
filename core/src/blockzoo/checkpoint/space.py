"""Free space: what a checkpoint needs on disk, made room for (pruning early what the save would prune anyway)
before any byte is written, and the message of a full disk."""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from blockzoo.checkpoint.format import CheckpointError
from blockzoo.checkpoint.retention import remove_checkpoint, step_directories

if TYPE_CHECKING:
    from blockzoo.checkpoint.gather import Layout
    from blockzoo.conversion import Origin


# Room for headers, YAML files and the file system's own blocks, beyond the tensors' bytes.
_SPACE_MARGIN = 4 * 2**20


def space_needed(layouts: Mapping[str, Layout], config: str, origin: Origin | None) -> int:
    """Bytes the checkpoint takes on disk (the tensors' bytes are known from the layouts), with a margin."""
    tensors = sum(
        math.prod(shape) * dtype.itemsize for layout in layouts.values() for dtype, shape in layout.tensors.values()
    )
    origin_files = sum(path.stat().st_size for path in origin.paths() if path.is_file()) if origin else 0
    return tensors + len(config) + origin_files + _SPACE_MARGIN


def make_room(directory: Path, needed: int, keep: int | None, log: Callable[[str], None]) -> None:
    """Raise unless the file system of `directory` has `needed` bytes free; with `keep`, prune the oldest `step_<N>`
    siblings first, down to `keep - 1` (the save and the pruning after it leave `keep`), never below one."""
    root = directory.parent
    free = shutil.disk_usage(root).free
    if free >= needed:
        return
    others = [path for _, path in step_directories(root) if path != directory]
    while keep is not None and free < needed and len(others) > max(keep - 1, 1):
        oldest = others.pop(0)
        remove_checkpoint(oldest)
        log(f"pruned {oldest} before saving {directory.name}: {_mib(free)} free, the checkpoint needs {_mib(needed)}")
        free = shutil.disk_usage(root).free
    if free < needed:
        raise CheckpointError(directory, no_space(root, needed, free))


def no_space(root: Path, needed: int, free: int | None = None) -> str:
    """The message of a full disk: before writing (`free` known), or found while writing (free: now)."""
    what = "not enough disk space to save the checkpoint" if free is not None else "the disk filled up while saving"
    free = shutil.disk_usage(root).free if free is None else free
    return (
        f"{what}: it needs about {_mib(needed)}, {_mib(free)} are free on the file system of {root} (free some "
        "space, or lower training.checkpoint_keep)"
    )


def _mib(count: int) -> str:
    return f"{count / 2**20:.1f} MiB"
