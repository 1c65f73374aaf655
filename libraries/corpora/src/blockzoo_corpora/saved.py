"""`datasets` directories written by `save_to_disk`: read as their Arrow files, in the order `state.json` lists
them (else every `*.arrow`, sorted), with pyarrow alone."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from blockzoo.data.errors import DatasetError
from blockzoo.data.formats import Batch, InputFormat
from blockzoo.data.inputs import InputFile, Piece
from blockzoo_corpora.columnar import ArrowFormat

MARKERS = ("state.json", "dataset_info.json")


class DatasetsFormat(InputFormat):
    auto = False  # recognised as a directory, never by a file's name
    directory_only = "a directory saved by `datasets`"

    def input_directory(self, path: Path, *, required: bool) -> InputFile | None:
        if (path / "dataset_dict.json").is_file():
            splits = ", ".join(str(child) for child in sorted(path.iterdir()) if child.is_dir()) or "none"
            raise DatasetError(f"{path} holds several splits saved by `datasets`; give one of them ({splits})")
        if not any((path / marker).is_file() for marker in MARKERS):
            if required:
                raise DatasetError(f"{path} is not {self.directory_only} (it holds no {' or '.join(MARKERS)})")
            return None
        parts = tuple(path / name for name in _arrow_files(path))
        if missing := [str(part) for part in parts if not part.is_file()]:
            raise DatasetError(f"the dataset {path} lacks its Arrow files {', '.join(missing)}")
        if not parts:
            raise DatasetError(f"the dataset {path} holds no Arrow files")
        return InputFile(path, "datasets", sum(part.stat().st_size for part in parts), parts)

    def pieces(self, file: InputFile) -> list[Piece]:
        arrow = ArrowFormat()
        return [piece for part in file.parts for piece in arrow.pieces(InputFile(part, "arrow", part.stat().st_size))]

    def read(self, piece: Piece, field: str) -> Iterator[Batch]:  # its pieces are Arrow files' pieces
        return ArrowFormat().read(piece, field)


def _arrow_files(path: Path) -> list[str]:
    state_path = path / "state.json"
    if not state_path.is_file():
        return sorted(child.name for child in path.glob("*.arrow"))
    try:
        state = json.loads(state_path.read_text())
        return [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DatasetError(f"cannot read the list of Arrow files in {state_path}: {error!r}") from None
