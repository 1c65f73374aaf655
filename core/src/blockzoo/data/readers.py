"""Streaming the documents of a work unit's pieces (see `inputs`), in batches, so memory does not grow with the
corpus. Torch-free; pyarrow (Parquet, Arrow) and zstandard (`.zst`) are imported only when such a file is read.

What a document is: `text`, a whole file; `paragraphs`, text between blank lines (lines of only whitespace) or a
file's end; `jsonl`, the `field` of each non-blank line's object; `parquet`, `arrow` and `datasets`, the `field`
column of each row (a string column; null rows are skipped). Text is UTF-8. Documents with no text (empty or only
whitespace) are skipped.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from blockzoo.data.errors import DatasetError
from blockzoo.data.inputs import InputFile, Piece

# Documents per batch, what a tokenizer encodes at once: its encodings (ids, token strings) of ~1024 documents of a
# few KB took 30 MiB more of a worker's peak than 256, for the same CPU time.
BATCH_DOCUMENTS = 256
INSTALL = "pip install 'blockzoo[datasets]'"

Batch = tuple[list[str], int]  # documents, and the input bytes read for them (an estimate for columnar files)


def read_piece(piece: Piece, field: str = "text") -> Iterator[Batch]:
    """The documents of one piece in batches of at most BATCH_DOCUMENTS, each with the input bytes it covers."""
    file = piece.file
    try:
        if file.format in ("parquet", "arrow"):
            yield from _columnar(piece, field)
        elif file.format == "text":
            with _open(file) as stream:
                yield _documents([_decode(stream.read(), file.path)]), piece.size
        else:
            yield from _lines(piece, field)
    except OSError as error:
        raise DatasetError(f"cannot read {file.path}: {error.strerror or error}") from None


def _documents(texts: Iterable[str | None]) -> list[str]:
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
    if file.compression == ".gz":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if file.compression == ".zst":
        try:
            import zstandard
        except ImportError:
            raise DatasetError(f"reading {file.path} needs the zstandard package: {INSTALL}") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw))
    return raw


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


# ---------------------------------------------------------------------------------------------------------------------
# Columnar formats: Parquet and Arrow IPC (file or stream), through pyarrow


def pyarrow_modules(path: Path) -> tuple[Any, Any, Any]:
    """pyarrow, pyarrow.ipc and pyarrow.parquet, or a DatasetError saying what to install to read `path`."""
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise DatasetError(f"reading {path} needs pyarrow: {INSTALL}") from None
    return pyarrow, pyarrow.ipc, pyarrow.parquet


def open_parquet(path: Path) -> Any:
    pyarrow, _, parquet = pyarrow_modules(path)
    try:
        return parquet.ParquetFile(path)
    except (pyarrow.ArrowException, OSError) as error:
        raise DatasetError(f"{path} is not a readable Parquet file: {error}") from None


def open_arrow_file(path: Path) -> Any:
    """An Arrow IPC file (random access) reader; close it (it is a context manager)."""
    pyarrow, ipc, _ = pyarrow_modules(path)
    try:
        return ipc.open_file(pyarrow.OSFile(str(path)))
    except (pyarrow.ArrowException, OSError) as error:
        raise DatasetError(f"{path} is not a readable Arrow IPC file: {error}") from None


def _columnar(piece: Piece, field: str) -> Iterator[Batch]:
    from blockzoo.data.inputs import is_arrow_file

    path = piece.file.path
    pyarrow, ipc, _ = pyarrow_modules(path)
    try:
        if piece.file.format == "parquet":
            parquet_file = open_parquet(path)
            _check_column(parquet_file.schema_arrow, field, path, pyarrow)
            groups = list(range(*piece.span)) if piece.span else list(range(parquet_file.num_row_groups))
            rows = sum(parquet_file.metadata.row_group(group).num_rows for group in groups)
            batches = parquet_file.iter_batches(batch_size=BATCH_DOCUMENTS, row_groups=groups, columns=[field])
            yield from _column_batches(batches, field, rows, piece.size)
        elif is_arrow_file(path):
            with open_arrow_file(path) as reader:
                _check_column(reader.schema, field, path, pyarrow)
                indices = range(*piece.span) if piece.span else range(reader.num_record_batches)
                batches = (reader.get_batch(index) for index in indices)
                yield from _column_batches(batches, field, None, piece.size, parts=len(indices))
        else:
            with ipc.open_stream(pyarrow.OSFile(str(path))) as reader:
                _check_column(reader.schema, field, path, pyarrow)
                yield from _column_batches(iter(reader), field, None, piece.size)
    except pyarrow.ArrowException as error:
        kind = "Parquet" if piece.file.format == "parquet" else "Arrow IPC"
        raise DatasetError(f"{path} is not a readable {kind} file: {error}") from None


def _check_column(schema: Any, field: str, path: Path, pyarrow: Any) -> None:
    if field not in schema.names:
        columns = ", ".join(map(repr, schema.names)) or "none"
        raise DatasetError(f"{path} has no column {field!r} (its columns: {columns}); choose with --field")
    kind = schema.field(field).type
    types = pyarrow.types
    if not (types.is_string(kind) or types.is_large_string(kind) or types.is_string_view(kind)):
        raise DatasetError(f"{path}: column {field!r} holds {kind}, expected strings")


def _column_batches(batches: Iterator[Any], field: str, rows: int | None, size: int, parts: int = 0) -> Iterator[Batch]:
    """Re-batch record batches to BATCH_DOCUMENTS rows (slices, not copies). Progress: by rows when their total is
    known, by record batch when their count is (`parts`), else all at the end."""
    reported = 0
    rows_read = 0
    for number, record_batch in enumerate(batches, start=1):
        column = record_batch.column(field)
        for offset in range(0, len(column), BATCH_DOCUMENTS):
            texts = column.slice(offset, BATCH_DOCUMENTS).to_pylist()
            rows_read += len(texts)
            if rows:
                done = size * rows_read // rows
            elif parts:
                done = size * (number - 1) // parts
            else:
                done = reported
            yield _documents(texts), done - reported
            reported = done
    yield [], size - reported
