"""What `blockzoo prepare` reads: its INPUT arguments (files, directories, globs) as input files of known formats,
and those files cut into *work units*, the pieces one worker tokenizes into one shard. Torch-free.

Formats are registered kinds (`blockzoo.data.formats`): the core's `text` (`*.txt`, `*.text`, `*.md`: a file is a
document), `paragraphs` (never chosen by auto: text whose documents are separated by blank lines) and `jsonl`
(`*.jsonl`), plain or ending in a registered compression (`.gz`; `.zst` with blockzoo-corpora); blockzoo-corpora's
`parquet`, `arrow` and `datasets` (a directory written by `save_to_disk`). `--format auto` asks the registered
formats which one a file's name is (the longest ending wins).
A directory expands to the recognised files under it (sorted by path; hidden files skipped; a subdirectory that
a format reads as a whole, such as a saved dataset, counts as one input); a glob (`'corpus/**/*.parquet'`,
quoted so that the shell leaves it) expands to the files it matches, sorted.

Work units depend on the inputs only, never on the number of workers, so that any number of workers writes the
same shards: consecutive small files are grouped, each format cuts large files (uncompressed JSONL
between lines, Parquet between row groups, Arrow IPC files between record batches), into units of about `UNIT_BYTES`
(16 MiB, uncompressed for Parquet).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from pathlib import Path

import attrs

from blockzoo.data.errors import DatasetError
from blockzoo.data.formats import InputFormat, compression_names, format_names, input_format, missing_provider

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
    compressed: bool = False  # a line file ending in a registered compression's ending (`.jsonl.gz`)


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
    formats = _Formats()
    if format != "auto":
        formats.get(format)  # an unknown format is named before any file is looked at
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
                files += _expand(Path(match), format, formats, explicit=True)
        else:
            files += _expand(Path(text), format, formats, explicit=True)
    return files


class _Formats:
    """The registered input formats and compressions, looked up once per `resolve_inputs`."""

    def __init__(self) -> None:
        from blockzoo.plugins.providers import FIRST_PARTY_TYPES

        self.names = format_names()
        self._loaded: dict[str, InputFormat] = {}
        self.compressions = compression_names()
        # Endings of compressions not installed too: such a file is named with what to install, not skipped.
        self.known_compressions = sorted(
            {*self.compressions, *(name for kind, name in FIRST_PARTY_TYPES if kind == "input_compression")}
        )

    def get(self, name: str) -> InputFormat:
        if name not in self._loaded:
            self._loaded[name] = input_format(name)
        return self._loaded[name]

    def all(self) -> list[tuple[str, InputFormat]]:
        return [(name, self.get(name)) for name in self.names]

    def endings(self, name: str) -> tuple[str, ...]:
        input_format = self.get(name)
        compressed = input_format.compressible
        suffixes = [f"{ending}.{compression}" for ending in input_format.extensions
                    for compression in self.known_compressions] if compressed else []  # fmt: skip
        return (*input_format.extensions, *suffixes)

    def matches(self, path: Path, name: str) -> bool:
        return path.name.lower().endswith(self.endings(name))

    def by_name(self, path: Path) -> str | None:
        """The format `--format auto` picks for a file: the one whose longest ending it has."""
        lower = path.name.lower()
        candidates = [
            (max(len(ending) for ending in self.endings(name) if lower.endswith(ending)), name)
            for name, input_format in self.all()
            if input_format.auto and self.matches(path, name)
        ]
        return max(candidates)[1] if candidates else None

    def describe_endings(self) -> str:
        return ", ".join(f"{ending} ({name})" for name, input_format in self.all() if input_format.auto
                         for ending in self.endings(name))  # fmt: skip


def _expand(path: Path, format: str, formats: _Formats, *, explicit: bool) -> list[InputFile]:
    if not path.exists():
        raise DatasetError(f"input {path} does not exist")
    if path.is_dir():
        for name, input_format in formats.all():
            directory = input_format.input_directory(path, required=format == name)
            if directory is None:
                continue
            if format not in ("auto", name):
                if not explicit:
                    return []  # found while walking a directory for files of another format
                raise DatasetError(f"{path} is {input_format.directory_only}, not --format {format} input")
            return [directory]
        found = [
            found_file
            for child in sorted(path.iterdir())
            if not child.name.startswith(".")
            for found_file in _expand(child, format, formats, explicit=False)
        ]
        if explicit and not found:
            known = ", ".join(sorted({ending for name in formats.names for ending in formats.endings(name)}))
            raise DatasetError(f"the directory {path} holds no input files of a recognised kind ({known})")
        return found
    if not path.is_file():
        raise DatasetError(f"input {path} is not a file or a directory")
    if format == "auto":
        chosen = formats.by_name(path)
    else:
        chosen = format if formats.matches(path, format) or explicit else None
    if chosen is None:
        if (explicit or format == "auto") and (hint := missing_provider(path)):
            raise DatasetError(hint)
        if not explicit:
            return []  # a file of another kind in a directory or among a glob's matches
        raise DatasetError(
            f"cannot tell the format of {path} from its name (known endings: {formats.describe_endings()}); "
            "give --format"
        )
    input_format = formats.get(chosen)
    if input_format.directory_only:
        raise DatasetError(f"{path} is a file; --format {chosen} reads {input_format.directory_only}")
    compression = path.suffix.lower().lstrip(".")
    compressed = input_format.compressible and compression in formats.known_compressions
    if compressed and compression not in formats.compressions:
        raise DatasetError(missing_provider(path) or f"no compression {compression!r} is installed to read {path}")
    return [InputFile(path, chosen, path.stat().st_size, compressed=compressed)]


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
    return input_format(file.format).pieces(file)


def spans(file: InputFile, sizes: list[int]) -> list[Piece]:
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
