"""The on-disk layout of a prepared dataset, shared by `blockzoo prepare` (writer) and the `memmap` dataset
(reader). Torch-free.

A dataset with path prefix `P` is:
- `P.bin`: every document's token ids, concatenated, as the smallest unsigned integer type that holds the
  vocabulary (uint8, uint16 or uint32), in the machine's byte order (little-endian on every supported platform);
- `P.idx`: int64 document offsets, one more than there are documents: document d is tokens
  `[offsets[d], offsets[d + 1])`; the first offset is 0, the last the number of tokens, every document has
  at least one token;
- `P.json`: metadata: format and version, token dtype, vocabulary size, counts, the end-of-document id and
  the tokenizer (`{"type": "byte"}` or `{"type": "huggingface", "eod_token": ...}`, whose `tokenizer.json` is
  copied to `P.tokenizer.json`), and the input files.
Files are written under temporary names and renamed at the end, so a failed run leaves no partial dataset.
"""

from __future__ import annotations

import array
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from blockzoo.data.errors import DatasetError
from blockzoo.data.tokenizer import BYTE, HUGGING_FACE, ByteTokenizer, HuggingFaceTokenizer, Tokenizer

FORMAT = "blockzoo-tokens"
VERSION = 1
# dtype name -> (array typecode, bytes per item)
TOKEN_DTYPES = {"uint8": ("B", 1), "uint16": ("H", 2), "uint32": ("I", 4)}
INDEX_TYPECODE = "q"  # int64
INDEX_ITEM_SIZE = 8


@attrs.frozen
class DatasetFiles:
    prefix: Path

    @property
    def tokens(self) -> Path:
        return self.prefix.with_name(self.prefix.name + ".bin")

    @property
    def index(self) -> Path:
        return self.prefix.with_name(self.prefix.name + ".idx")

    @property
    def metadata(self) -> Path:
        return self.prefix.with_name(self.prefix.name + ".json")

    @property
    def tokenizer(self) -> Path:
        return self.prefix.with_name(self.prefix.name + ".tokenizer.json")


def token_dtype(vocab_size: int) -> str:
    """The smallest unsigned dtype that holds every id of a vocabulary."""
    for name, (_, size) in TOKEN_DTYPES.items():
        if vocab_size <= 2 ** (8 * size):
            return name
    raise DatasetError(f"a vocabulary of {vocab_size} ids does not fit 32-bit token ids")


class DatasetWriter:
    """Writes documents (lists of token ids) to a dataset, streaming the tokens to disk.

    Use as a context manager: on a clean exit it writes the index and metadata and renames the files into place
    (replacing a dataset of the same prefix); on an exception it removes the temporary files.
    """

    FLUSH_TOKENS = 1 << 20

    def __init__(self, prefix: str | Path, tokenizer: Tokenizer, sources: Sequence[str] = ()):
        self.files = DatasetFiles(Path(prefix))
        self.tokenizer = tokenizer
        self.sources = list(sources)
        self.dtype = token_dtype(tokenizer.vocab_size)
        self._typecode = TOKEN_DTYPES[self.dtype][0]
        self._buffer = array.array(self._typecode)
        self._offsets = array.array(INDEX_TYPECODE, [0])
        self.files.prefix.parent.mkdir(parents=True, exist_ok=True)
        written = [self.files.tokens, self.files.index, self.files.metadata]
        if isinstance(tokenizer, HuggingFaceTokenizer):
            written.append(self.files.tokenizer)
        self._temporary = {path: _temporary(path) for path in written}
        self._tokens_file = open(self._temporary[self.files.tokens], "wb")  # noqa: SIM115 - closed on exit

    @property
    def num_documents(self) -> int:
        return len(self._offsets) - 1

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    def add(self, ids: Sequence[int]) -> None:
        """Add a document (at least one token)."""
        if not ids:
            raise ValueError("a document needs at least one token")
        self._buffer.extend(ids)
        self._offsets.append(self._offsets[-1] + len(ids))
        if len(self._buffer) >= self.FLUSH_TOKENS:
            self._flush()

    def _flush(self) -> None:
        self._buffer.tofile(self._tokens_file)
        self._buffer = array.array(self._typecode)

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, kind: type | None, *_: Any) -> None:
        if kind is None:
            self._finish()
        else:
            self._tokens_file.close()
            for path in self._temporary.values():
                path.unlink(missing_ok=True)

    def _finish(self) -> None:
        self._flush()
        self._tokens_file.close()
        with open(self._temporary[self.files.index], "wb") as index_file:
            self._offsets.tofile(index_file)
        metadata = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": self.dtype,
            "vocab_size": self.tokenizer.vocab_size,
            "eod_token_id": self.tokenizer.eod_token_id,
            "num_documents": self.num_documents,
            "num_tokens": self.num_tokens,
            "tokenizer": self.tokenizer.to_metadata(),
            "sources": self.sources,
        }
        self._temporary[self.files.metadata].write_text(json.dumps(metadata, indent=2) + "\n")
        if isinstance(self.tokenizer, HuggingFaceTokenizer):
            shutil.copyfile(self.tokenizer.path, self._temporary[self.files.tokenizer])
        # A dataset whose metadata is present is complete: the old metadata goes first, the new one last.
        self.files.metadata.unlink(missing_ok=True)
        self.files.tokenizer.unlink(missing_ok=True)  # a tokenizer copied for an earlier dataset of this prefix
        for path in sorted(self._temporary, key=lambda path: path == self.files.metadata):
            os.replace(self._temporary[path], path)


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


# ---------------------------------------------------------------------------------------------------------------------
# Reading


_METADATA_TYPES = {
    "format": str,
    "version": int,
    "dtype": str,
    "vocab_size": int,
    "eod_token_id": (int, type(None)),
    "num_documents": int,
    "num_tokens": int,
    "tokenizer": dict,
}


def read_metadata(files: DatasetFiles) -> dict[str, Any]:
    """The metadata of a prepared dataset, checked: every problem is a DatasetError naming the file."""
    path = files.metadata
    if not path.is_file():
        raise DatasetError(
            f"no dataset at {files.prefix}: {path} does not exist (write one with `blockzoo prepare ... --output "
            f"{files.prefix}`)"
        )
    try:
        metadata = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DatasetError(f"cannot read the dataset metadata {path}: {error}") from None
    if not isinstance(metadata, dict):
        raise DatasetError(f"the dataset metadata {path} is not a JSON object")
    if metadata.get("format") != FORMAT:
        raise DatasetError(f'{path} is not the metadata of a blockzoo dataset (no "format": "{FORMAT}")')
    for key, expected in _METADATA_TYPES.items():
        value = metadata.get(key)
        if key not in metadata or isinstance(value, bool) or not isinstance(value, expected):
            raise DatasetError(f"the dataset metadata {path} has no valid {key!r} (got {value!r})")
    if metadata["version"] > VERSION:
        raise DatasetError(
            f"{path} is of dataset format version {metadata['version']}; this blockzoo reads up to {VERSION}"
        )
    if metadata["dtype"] not in TOKEN_DTYPES:
        raise DatasetError(f"{path}: unknown token dtype {metadata['dtype']!r} (known: {', '.join(TOKEN_DTYPES)})")
    if metadata["tokenizer"].get("type") not in (BYTE, HUGGING_FACE):
        raise DatasetError(f"{path}: unknown tokenizer {metadata['tokenizer']!r}")
    return metadata


def tokenizer_of(files: DatasetFiles, metadata: dict[str, Any]) -> Tokenizer:
    """The tokenizer a dataset was prepared with."""
    if metadata["tokenizer"]["type"] == HUGGING_FACE:
        return HuggingFaceTokenizer(files.tokenizer, metadata["tokenizer"].get("eod_token"))
    return ByteTokenizer()
