"""What `blockzoo prepare` reads: its INPUT arguments (files, directories, globs) as input files of known formats,
and those files cut into *work units*, the pieces one worker tokenizes into one shard. Torch-free.

Formats, and how `--format auto` recognises them:
- `parquet` (`*.parquet`), `arrow` (`*.arrow`: an Arrow IPC file or stream, `datasets`' cache shards among them);
- `datasets`: a directory written by `datasets`' `save_to_disk` (it holds `state.json` / `dataset_info.json`);
- `jsonl` (`*.jsonl`, `*.jsonl.gz`, `*.jsonl.zst`); `text` (`*.txt`, `*.text`, `*.md`: a file is a document);
  `paragraphs` (never chosen by auto: text whose documents are separated by blank lines). The line formats
  (`text`, `paragraphs`, `jsonl`) are decompressed when their name ends in `.gz` or `.zst`.
A directory expands to the recognised files under it (sorted by path; hidden files skipped; a subdirectory saved
by `datasets` counts as one input); a glob (`'corpus/**/*.parquet'`, quoted so that the shell leaves it) expands
to the files it matches, sorted.

Work units depend on the inputs only, never on the number of workers, so that any number of workers writes the
same shards: consecutive small files are grouped, large Parquet files are cut between row groups, Arrow IPC
files between record batches and uncompressed JSONL files between lines, into units of about `UNIT_BYTES`
(16 MiB, uncompressed for Parquet).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Sequence
from pathlib import Path

import attrs

from blockzoo.data.errors import DatasetError

FORMATS = ("auto", "text", "paragraphs", "jsonl", "parquet", "arrow", "datasets")
EXTENSIONS = {
    "parquet": (".parquet",),
    "arrow": (".arrow",),
    "jsonl": (".jsonl", ".jsonl.gz", ".jsonl.zst"),
    "text": (".txt", ".text", ".md", ".txt.gz", ".txt.zst"),
}
EXTENSIONS["paragraphs"] = EXTENSIONS["text"]
COMPRESSIONS = (".gz", ".zst")
DATASETS_MARKERS = ("state.json", "dataset_info.json")
# About the input bytes (uncompressed, for Parquet) of one work unit, one shard: small enough that the units keep
# every worker busy to the end (a unit is some seconds of one CPU), large enough that a large corpus is not
# thousands of files.
UNIT_BYTES = 16 << 20
_GLOB_CHARACTERS = "*?["


@attrs.frozen
class InputFile:
    """One input: a file, or a `datasets` directory (its Arrow files are `parts`)."""

    path: Path
    format: str
    size: int  # bytes on disk
    parts: tuple[Path, ...] = ()  # a `datasets` directory's Arrow files, in order

    @property
    def compression(self) -> str | None:
        suffix = self.path.suffix
        return suffix if self.format in ("text", "paragraphs", "jsonl") and suffix in COMPRESSIONS else None


@attrs.frozen
class Piece:
    """Part of an input file: all of it (`span` None), Parquet row groups or Arrow record batches
    `[start, stop)`, or JSONL bytes `[start, stop)` (each line in the range its first byte is in)."""

    file: InputFile
    span: tuple[int, int] | None
    size: int  # estimated input bytes, for the progress bar


@attrs.frozen
class WorkUnit:
    number: int
    pieces: tuple[Piece, ...]

    @property
    def size(self) -> int:
        return sum(piece.size for piece in self.pieces)


def resolve_inputs(inputs: Sequence[str | Path], format: str = "auto") -> list[InputFile]:
    """The input files the arguments name, in order, each with its format."""
    if format not in FORMATS:
        raise DatasetError(f"unknown input format {format!r} (known: {', '.join(FORMATS)})")
    if not inputs:
        raise DatasetError("no input given")
    files: list[InputFile] = []
    for argument in inputs:
        text = str(argument)
        if not os.path.lexists(text) and any(character in text for character in _GLOB_CHARACTERS):
            matches = sorted(glob.glob(text, recursive=True))
            if not matches:
                raise DatasetError(f"the pattern {text!r} matches no files")
            for match in matches:  # named by the user: a file of an unknown kind is an error, as if named itself
                files += _expand(Path(match), format, explicit=True)
        else:
            files += _expand(Path(text), format, explicit=True)
    return files


def _expand(path: Path, format: str, *, explicit: bool) -> list[InputFile]:
    if not path.exists():
        raise DatasetError(f"input {path} does not exist")
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            splits = ", ".join(str(child) for child in sorted(path.iterdir()) if child.is_dir()) or "none"
            raise DatasetError(f"{path} holds several splits saved by `datasets`; give one of them ({splits})")
        if any((path / marker).is_file() for marker in DATASETS_MARKERS):
            if format not in ("auto", "datasets"):
                if not explicit:
                    return []  # found while walking a directory for files of another format
                raise DatasetError(f"{path} is a directory saved by `datasets`, not --format {format} input")
            return [_datasets_directory(path)]
        if format == "datasets":
            markers = " or ".join(DATASETS_MARKERS)
            raise DatasetError(f"{path} is not a directory saved by `datasets` (it holds no {markers})")
        found = [
            found_file
            for child in sorted(path.iterdir())
            if not child.name.startswith(".")
            for found_file in _expand(child, format, explicit=False)
        ]
        if explicit and not found:
            known = ", ".join(sorted({ext for exts in EXTENSIONS.values() for ext in exts}))
            raise DatasetError(f"the directory {path} holds no input files of a recognised kind ({known})")
        return found
    if not path.is_file():
        raise DatasetError(f"input {path} is not a file or a directory")
    chosen = _format_of(path) if format == "auto" else format if _matches(path, format) or explicit else None
    if chosen is None:
        if not explicit:
            return []  # a file of another kind in a directory or among a glob's matches
        raise DatasetError(
            f"cannot tell the format of {path} from its name (known endings: {_endings()}); give --format"
        )
    if chosen == "datasets":
        raise DatasetError(f"{path} is a file; --format datasets reads a directory written by `save_to_disk`")
    return [InputFile(path, chosen, path.stat().st_size)]


def _format_of(path: Path) -> str | None:
    return next((format for format in ("parquet", "arrow", "jsonl", "text") if _matches(path, format)), None)


def _matches(path: Path, format: str) -> bool:
    return path.name.lower().endswith(EXTENSIONS.get(format, ()))


def _endings() -> str:
    return ", ".join(f"{ending} ({format})" for format in ("parquet", "arrow", "jsonl", "text")
                     for ending in EXTENSIONS[format])  # fmt: skip


def _datasets_directory(path: Path) -> InputFile:
    """A `save_to_disk` directory: its Arrow files as `state.json` lists them (else every `*.arrow`, sorted)."""
    state_path = path / "state.json"
    names: list[str]
    if state_path.is_file():
        try:
            state = json.loads(state_path.read_text())
            names = [entry["filename"] for entry in state["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise DatasetError(f"cannot read the list of Arrow files in {state_path}: {error!r}") from None
    else:
        names = sorted(child.name for child in path.glob("*.arrow"))
    parts = tuple(path / name for name in names)
    if missing := [str(part) for part in parts if not part.is_file()]:
        raise DatasetError(f"the dataset {path} lacks its Arrow files {', '.join(missing)}")
    if not parts:
        raise DatasetError(f"the dataset {path} holds no Arrow files")
    return InputFile(path, "datasets", sum(part.stat().st_size for part in parts), parts)


# ---------------------------------------------------------------------------------------------------------------------
# Work units


def plan_units(files: Sequence[InputFile]) -> list[WorkUnit]:
    """The input cut into work units of about UNIT_BYTES, in input order (see the module's doc)."""
    units: list[WorkUnit] = []
    pending: list[Piece] = []
    pending_size = 0
    for piece in (piece for file in files for piece in _pieces(file)):
        if pending and pending_size + piece.size > UNIT_BYTES:
            units.append(WorkUnit(len(units), tuple(pending)))
            pending, pending_size = [], 0
        pending.append(piece)
        pending_size += piece.size
    if pending:
        units.append(WorkUnit(len(units), tuple(pending)))
    return units


def _pieces(file: InputFile) -> list[Piece]:
    if file.format == "datasets":
        parts = [InputFile(part, "arrow", part.stat().st_size) for part in file.parts]
        return [piece for part in parts for piece in _pieces(part)]
    if file.format == "parquet":
        from blockzoo.data.readers import open_parquet

        metadata = open_parquet(file.path).metadata
        # Uncompressed sizes: a unit is about UNIT_BYTES of text whatever the compression.
        return _spans(file, [metadata.row_group(group).total_byte_size for group in range(metadata.num_row_groups)])
    if file.format == "arrow" and is_arrow_file(file.path):
        from blockzoo.data.readers import open_arrow_file

        with open_arrow_file(file.path) as reader:
            batches = reader.num_record_batches
        return _spans(file, [file.size // max(batches, 1)] * batches)
    if file.format == "jsonl" and file.compression is None and file.size > UNIT_BYTES:
        starts = range(0, file.size, UNIT_BYTES)
        return [Piece(file, (start, min(start + UNIT_BYTES, file.size)), min(UNIT_BYTES, file.size - start))
                for start in starts]  # fmt: skip
    return [Piece(file, None, file.size)]


def _spans(file: InputFile, sizes: list[int]) -> list[Piece]:
    """Consecutive parts (row groups, record batches) of the given sizes, grouped into pieces of about UNIT_BYTES."""
    pieces: list[Piece] = []
    start = size = 0
    for index, part_size in enumerate(sizes):
        if index > start and size + part_size > UNIT_BYTES:
            pieces.append(Piece(file, (start, index), size))
            start, size = index, 0
        size += part_size
    if len(sizes) > start or not pieces:
        pieces.append(Piece(file, (start, len(sizes)), size))
    return pieces


def is_arrow_file(path: Path) -> bool:
    """Whether an `.arrow` file is in the IPC file format (random access), not the stream format."""
    with open(path, "rb") as file:
        return file.read(6) == b"ARROW1"
