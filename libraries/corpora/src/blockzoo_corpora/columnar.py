"""Parquet and Arrow IPC (file or stream) inputs, through pyarrow: a document is the `--field` column of a row (a
string column; null rows are skipped). Large files are cut between row groups (Parquet, by their uncompressed
size) or record batches (Arrow IPC files), so that a unit is about `UNIT_BYTES` of text whatever the compression."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from blockzoo.data.errors import DatasetError
from blockzoo.data.formats import Batch, InputFormat
from blockzoo.data.inputs import InputFile, Piece, spans

# Rows per batch, what a tokenizer encodes at once (as the core's line formats).
from blockzoo.data.readers import BATCH_DOCUMENTS


class ParquetFormat(InputFormat):
    extensions = (".parquet",)

    def pieces(self, file: InputFile) -> list[Piece]:
        metadata = open_parquet(file.path).metadata
        return spans(file, [metadata.row_group(group).total_byte_size for group in range(metadata.num_row_groups)])

    def read(self, piece: Piece, field: str) -> Iterator[Batch]:
        path = piece.file.path
        pyarrow, _, _ = pyarrow_modules(path)
        parquet_file = open_parquet(path)
        with _readable(path, "Parquet", pyarrow):
            _check_column(parquet_file.schema_arrow, field, path, pyarrow)
            groups = list(range(*piece.span)) if piece.span else list(range(parquet_file.num_row_groups))
            rows = sum(parquet_file.metadata.row_group(group).num_rows for group in groups)
            batches = parquet_file.iter_batches(batch_size=BATCH_DOCUMENTS, row_groups=groups, columns=[field])
            yield from _column_batches(batches, field, rows, piece.size)


class ArrowFormat(InputFormat):
    extensions = (".arrow",)

    def pieces(self, file: InputFile) -> list[Piece]:
        if not is_arrow_file(file.path):  # a stream: read from its start, one piece
            return [Piece(file, None, file.size)]
        with open_arrow_file(file.path) as reader:
            batches = reader.num_record_batches
        return spans(file, [file.size // max(batches, 1)] * batches)

    def read(self, piece: Piece, field: str) -> Iterator[Batch]:
        path = piece.file.path
        pyarrow, ipc, _ = pyarrow_modules(path)
        with _readable(path, "Arrow IPC", pyarrow):
            if is_arrow_file(path):
                with open_arrow_file(path) as reader:
                    _check_column(reader.schema, field, path, pyarrow)
                    indices = range(*piece.span) if piece.span else range(reader.num_record_batches)
                    batches = (reader.get_batch(index) for index in indices)
                    yield from _column_batches(batches, field, None, piece.size, parts=len(indices))
            else:
                with ipc.open_stream(pyarrow.OSFile(str(path))) as reader:
                    _check_column(reader.schema, field, path, pyarrow)
                    yield from _column_batches(iter(reader), field, None, piece.size)


class _readable:
    """pyarrow's errors while reading as a DatasetError naming the file."""

    def __init__(self, path: Path, kind: str, pyarrow: Any):
        self.path, self.kind, self.pyarrow = path, kind, pyarrow

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> None:
        if error is not None and isinstance(error, self.pyarrow.ArrowException):
            raise DatasetError(f"{self.path} is not a readable {self.kind} file: {error}") from None


def is_arrow_file(path: Path) -> bool:
    """Whether an `.arrow` file is in the IPC file format (random access), not the stream format."""
    with open(path, "rb") as file:
        return file.read(6) == b"ARROW1"


def pyarrow_modules(path: Path) -> tuple[Any, Any, Any]:
    """pyarrow, pyarrow.ipc and pyarrow.parquet, or a DatasetError saying what to install to read `path`."""
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise DatasetError(f"reading {path} needs pyarrow: pip install pyarrow") from None
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
            yield texts, done - reported
            reported = done
    yield [], size - reported
