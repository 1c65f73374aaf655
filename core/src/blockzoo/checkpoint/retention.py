"""A run's `step_<N>` checkpoints: finding the latest valid one, and pruning the older ones so that no half-deleted
directory ever looks complete."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from blockzoo.checkpoint.durable import fsync
from blockzoo.checkpoint.format import METADATA_FILE, STEP_DIRECTORY, CheckpointError
from blockzoo.checkpoint.reading import verify_checkpoint


def step_directories(root: Path) -> list[tuple[int, Path]]:
    """`step_<N>` checkpoints (with their metadata) under `root`, oldest first (unverified)."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = STEP_DIRECTORY.fullmatch(path.name)
        if match and (path / METADATA_FILE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(root: str | Path, *, report: Callable[[str], None] | None = None) -> Path | None:
    """The newest valid `step_<N>` checkpoint under `root` (highest N), or None. A newer one that fails
    `verify_checkpoint` (corrupted, truncated, edited, incomplete) is skipped, and `report` told which and why."""
    for _, path in reversed(step_directories(Path(root))):
        try:
            verify_checkpoint(path)
        except CheckpointError as error:
            if report is not None:
                report(f"skipped checkpoint {path}: {error}")
            continue
        return path
    return None


def keep_last(root: str | Path, count: int) -> list[Path]:
    """Remove all but the `count` latest `step_<N>` checkpoints under `root` (call on one rank); returns the removed.

    Each is renamed `.step_<N>.deleting` before it is removed, so an interrupted pruning never leaves a directory
    that looks like a checkpoint; what earlier interrupted saves and prunings left (`.*.partial`, `.*.deleting`,
    `.*.previous`) is removed too."""
    if count < 1:
        raise ValueError(f"keep_last: count must be >= 1, got {count}")
    root = Path(root)
    removed = [path for _, path in step_directories(root)[:-count]]
    for path in removed:
        remove_checkpoint(path)
    for leftover in root.glob(".step_*"):
        if leftover.is_dir() and leftover.suffix in (".partial", ".deleting", ".previous"):
            shutil.rmtree(leftover, ignore_errors=True)
    return removed


def remove_checkpoint(path: Path) -> None:
    """Remove a checkpoint directory: first renamed (atomic) out of the `step_<N>` names, then deleted."""
    doomed = path.parent / f".{path.name}.deleting"
    if doomed.exists():
        shutil.rmtree(doomed)
    path.rename(doomed)
    fsync(path.parent)
    shutil.rmtree(doomed)
