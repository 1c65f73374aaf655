"""The `origin/` files of a checkpoint whose model was imported from another format (its config, tokenizer,
generation settings), kept for exports to give back."""

from __future__ import annotations

import shutil
from pathlib import Path

from blockzoo.checkpoint.format import ORIGIN_DIRECTORY, CheckpointError
from blockzoo.checkpoint.metadata import read_metadata
from blockzoo.conversion import Origin


def copy_origin(origin: Origin, destination: Path) -> None:
    destination.mkdir()
    for path in origin.paths():
        if not path.is_file():
            raise CheckpointError(path, "is gone: the model's origin files are needed to save it (with the checkpoint)")
        shutil.copyfile(path, destination / path.name)


def read_origin(directory: str | Path) -> Origin | None:
    """The origin files a checkpoint keeps (None when its model was not imported from another format)."""
    directory = Path(directory)
    prefix = f"{ORIGIN_DIRECTORY}/"
    names = [file.removeprefix(prefix) for file in read_metadata(directory)["files"] if file.startswith(prefix)]
    return Origin(directory / ORIGIN_DIRECTORY, tuple(names)) if names else None
