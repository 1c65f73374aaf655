"""Streaming the documents of a work unit's pieces (see `inputs`), in batches, so memory does not grow with the
corpus; the core's own input formats, which need no library: `text`, `paragraphs` and `jsonl`. Torch-free.

What a document is: `text`, a whole file; `paragraphs`, text between blank lines (lines of only whitespace) or a
file's end; `jsonl`, the `field` of each non-blank line's object (blockzoo-corpora's formats say theirs). Text is
UTF-8. Documents with no text (empty or only whitespace) are skipped, whatever the format.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from blockzoo.data import inputs
from blockzoo.data.errors import DatasetError
from blockzoo.data.formats import Batch, InputFormat, input_format, open_compressed
from blockzoo.data.inputs import InputFile, Piece

# Documents per batch, what a tokenizer encodes at once: its encodings (ids, token strings) of ~1024 documents of a
# few KB took 30 MiB more of a worker's peak than 256, for the same CPU time.
BATCH_DOCUMENTS = 256


def read_piece(piece: Piece, field: str = "text") -> Iterator[Batch]:
    """The documents of one piece in batches of at most BATCH_DOCUMENTS, each with the input bytes it covers."""
    file = piece.file
    try:
        for texts, read in input_format(file.format).read(piece, field):
            yield documents(texts), read
    except OSError as error:
        raise DatasetError(f"cannot read {file.path}: {error.strerror or error}") from None


class TextFormat(InputFormat):
    extensions = (".txt", ".text", ".md")
    compressible = True

    def read(self, piece: Piece, field: str) -> Iterator[Batch]:
        with _open(piece.file) as stream:
            yield [_decode(stream.read(), piece.file.path)], piece.size


class ParagraphsFormat(TextFormat):
    auto = False

    def read(self, piece: Piece, field: str) -> Iterator[Batch]:
        return _lines(piece, field)


class JsonlFormat(InputFormat):
    extensions = (".jsonl",)
    compressible = True

    def pieces(self, file: InputFile) -> list[Piece]:
        """An uncompressed file cut between lines (each line in the piece its first byte is in)."""
        unit = inputs.UNIT_BYTES
        if file.compressed or file.size <= unit:
            return [Piece(file, None, file.size)]
        return [Piece(file, (start, min(start + unit, file.size)), min(unit, file.size - start))
                for start in range(0, file.size, unit)]  # fmt: skip

    def read(self, piece: Piece, field: str) -> Iterator[Batch]:
        return _lines(piece, field)


def documents(texts: Iterable[str | None]) -> list[str]:
    return [text for text in texts if text and not text.isspace()]


def _decode(data: bytes, path: Path) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DatasetError(f"{path} is not UTF-8 text ({error.reason})") from None


# ---------------------------------------------------------------------------------------------------------------------
# Line formats: paragraphs and JSONL, plain or compressed


def _open(file: InputFile, raw: IO[bytes] | None = None) -> IO[bytes]:
    """The file's bytes, decompressed (from `raw`, the file opened in binary, when given)."""
    raw = raw if raw is not None else open(file.path, "rb")  # noqa: SIM115 - closed with the reader
    return open_compressed(file.path, raw) if file.compressed else raw


def _lines(piece: Piece, field: str) -> Iterator[Batch]:
    file = piece.file
    start, stop = piece.span or (0, None)
    with open(file.path, "rb") as raw:
        if start > 0:  # a line belongs to the span its first byte is in: skip the one that began before
            raw.seek(start - 1)
            raw.readline()
        line_number = _LineNumbers(file.path, raw.tell())
        with _open(file, raw) as stream:
            lines = _numbered_lines(stream, raw, stop, line_number)
            documents = _paragraphs(lines) if file.format == "paragraphs" else _jsonl(lines, line_number, field)
            batch: list[str] = []
            read = start
            end = piece.size if piece.span is None else stop
            for document, position in documents:
                if document and not document.isspace():
                    batch.append(document)
                if len(batch) >= BATCH_DOCUMENTS:
                    yield batch, min(position, end) - read
                    batch, read = [], min(position, end)
            yield batch, end - read


class _LineNumbers:
    """Line numbers for messages: line i of a piece (from 0) is line `first + i` of its file, where `first` is
    counted only when a message needs it (a piece may start in the middle of a large file)."""

    def __init__(self, path: Path, offset: int):
        self.path = path
        self.offset = offset
        self.first = 1 if offset == 0 else None

    def __call__(self, relative: int) -> int:
        if self.first is None:
            self.first = 1
            with open(self.path, "rb") as file:
                remaining = self.offset
                while remaining > 0:
                    chunk = file.read(min(remaining, 1 << 20))
                    self.first += chunk.count(b"\n")
                    remaining -= len(chunk)
        return self.first + relative

    def where(self, relative: int) -> str:
        return f"{self.path} line {self(relative)}"


def _numbered_lines(
    stream: IO[bytes], raw: IO[bytes], stop: int | None, line_number: _LineNumbers
) -> Iterator[tuple[int, str, int]]:
    """(line index in the piece, text, bytes of the raw file read so far) of each line that starts before `stop`."""
    for relative, line in enumerate(iter(stream.readline, b"")):
        position = raw.tell()
        if stop is not None and position - len(line) >= stop:
            return
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as error:
            raise DatasetError(f"{line_number.where(relative)} is not UTF-8 text ({error.reason})") from None
        yield relative, text, position


def _paragraphs(lines: Iterable[tuple[int, str, int]]) -> Iterator[tuple[str, int]]:
    paragraph: list[str] = []
    position = 0
    for _, line, position in lines:
        if not line.isspace():
            paragraph.append(line)
        elif paragraph:
            yield "".join(paragraph).rstrip("\n"), position
            paragraph = []
    if paragraph:
        yield "".join(paragraph).rstrip("\n"), position


def _jsonl(lines: Iterable[tuple[int, str, int]], line_number: _LineNumbers, field: str) -> Iterator[tuple[str, int]]:
    for relative, line, position in lines:
        if line.isspace():
            continue
        where = line_number.where
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DatasetError(f"{where(relative)}: not valid JSON: {error.msg} (column {error.colno})") from None
        if not isinstance(record, dict):
            raise DatasetError(f"{where(relative)}: expected a JSON object, got {type(record).__name__}")
        if field not in record:
            fields = ", ".join(map(repr, record)) or "none"
            raise DatasetError(f"{where(relative)}: no field {field!r} (its fields: {fields}); choose with --field")
        text = record[field]
        if not isinstance(text, str):
            raise DatasetError(f"{where(relative)}: field {field!r} holds {type(text).__name__}, expected a string")
        yield text, position
