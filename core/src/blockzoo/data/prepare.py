"""`blockzoo prepare`: tokenize text or JSONL files into a dataset the `memmap` type reads. Torch-free.

What a document is, per input format:
- `text`: each file is one document;
- `paragraphs`: documents are separated by one or more blank lines (lines of only whitespace); a file's end
  also ends a document;
- `jsonl`: each non-blank line is a JSON object whose `field` (default `text`) holds one document.
Files are read as UTF-8. Documents with no text (empty or only whitespace) are skipped. The tokenizer's
end-of-document token, when it has one (the byte tokenizer always does), is appended to every document.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from blockzoo.data.errors import DatasetError
from blockzoo.data.storage import DatasetWriter
from blockzoo.data.tokenizer import load_tokenizer

FORMATS = ("text", "paragraphs", "jsonl")
_ENCODE_BATCH = 256


def prepare(
    inputs: Sequence[str | Path],
    output: str | Path,
    *,
    tokenizer: str | Path = "byte",
    format: str = "text",
    field: str = "text",
    eod_token: str | None = None,
) -> dict[str, Any]:
    """Tokenize the documents of `inputs` into the dataset with path prefix `output`; returns its metadata."""
    if format not in FORMATS:
        raise DatasetError(f"unknown input format {format!r} (known: {', '.join(FORMATS)})")
    paths = [Path(path) for path in inputs]
    if not paths:
        raise DatasetError("no input files given")
    for path in paths:
        if not path.is_file():
            raise DatasetError(f"input file {path} {'is not a file' if path.exists() else 'does not exist'}")
    if Path(output).is_dir():
        raise DatasetError(f"the output {output} is a directory; give a path prefix such as {Path(output) / 'tokens'}")
    encoder = load_tokenizer(tokenizer, eod_token=eod_token)
    documents = (document for path in paths for document in read_documents(path, format, field))
    with DatasetWriter(output, encoder, sources=[str(path) for path in paths]) as writer:
        for chunk in _chunks(documents, _ENCODE_BATCH):
            for ids in encoder.encode_batch(chunk):
                if encoder.eod_token_id is not None:
                    ids.append(encoder.eod_token_id)
                if ids:
                    writer.add(ids)
        if writer.num_documents == 0:
            raise DatasetError(f"the corpus is empty: {', '.join(map(str, paths))} hold no document with text")
    return {
        "prefix": str(output),
        "dtype": writer.dtype,
        "vocab_size": encoder.vocab_size,
        "num_documents": writer.num_documents,
        "num_tokens": writer.num_tokens,
    }


def read_documents(path: Path, format: str, field: str = "text") -> Iterator[str]:
    """The documents of one input file with text in them (see the module's doc for what a document is)."""
    try:
        with open(path, encoding="utf-8") as file:
            if format == "text":
                documents: Iterable[str] = [file.read()]
            elif format == "paragraphs":
                documents = _paragraphs(file)
            else:
                documents = _jsonl_documents(file, path, field)
            yield from (document for document in documents if document.strip())
    except UnicodeDecodeError as error:
        raise DatasetError(f"{path} is not UTF-8 text ({error.reason})") from None
    except OSError as error:
        raise DatasetError(f"cannot read {path}: {error.strerror or error}") from None


def _paragraphs(lines: Iterable[str]) -> Iterator[str]:
    paragraph: list[str] = []
    for line in lines:
        if line.strip():
            paragraph.append(line)
        elif paragraph:
            yield "".join(paragraph).rstrip("\n")
            paragraph = []
    if paragraph:
        yield "".join(paragraph).rstrip("\n")


def _jsonl_documents(lines: Iterable[str], path: Path, field: str) -> Iterator[str]:
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DatasetError(f"{path} line {number}: not valid JSON: {error.msg} (column {error.colno})") from None
        if not isinstance(record, dict):
            raise DatasetError(f"{path} line {number}: expected a JSON object, got {type(record).__name__}")
        if field not in record:
            fields = ", ".join(map(repr, record)) or "none"
            raise DatasetError(f"{path} line {number}: no field {field!r} (its fields: {fields}); choose with --field")
        if not isinstance(record[field], str):
            raise DatasetError(
                f"{path} line {number}: field {field!r} holds {type(record[field]).__name__}, expected a string"
            )
        yield record[field]


def _chunks(items: Iterable[str], size: int) -> Iterator[list[str]]:
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk
