"""The on-disk layout of a prepared dataset, shared by `blockzoo prepare` (writer) and the `memmap` dataset
(reader). Torch-free.

A dataset with path prefix `P` (say `data/tokens`) is one or more *shards*, each a pair of files, and `P.json`:
- `<shard>.bin`: the shard's documents' token ids, concatenated, as the smallest unsigned integer type that holds
  the vocabulary (uint8, uint16 or uint32), in the machine's byte order (little-endian on every supported platform);
- `<shard>.idx`: int64 document offsets, one more than there are documents: document d is tokens
  `[offsets[d], offsets[d + 1])`; the first offset is 0, the last the number of tokens, every document has
  at least one token;
- `P.json`: metadata: format and version, token dtype, vocabulary size, counts, the end-of-document id, the
  tokenizer (`{"type": "byte"}`, or `{"type": TOKENIZER_FILE, "eod_token": ...}` for a `tokenizer.json`, which is
  copied to `P.tokenizer.json`), the input files, and the shards in order (`{"name", "num_documents", "num_tokens"}`,
  names relative to P's directory). The documents of the dataset are those of its shards, in that order.
A dataset of one shard names it `P` (`P.bin`, `P.idx`, the layout of format version 1, which had no shard list);
several are `P.00000`, `P.00001`, ...

`P.json` is the completion marker. A writer writes every shard under temporary names (`.<name>.tmp`); once all
are whole it removes the `P.json` of an older dataset of this prefix, renames the shards into place, and writes
`P.json` last, atomically (a temporary name, then a rename). So whatever kills a writer, and whenever, the
prefix holds either the older dataset, complete, or no `P.json` (refused by the reader); a writer starting
removes the temporaries one it replaces left.
"""

from __future__ import annotations

import array
import json
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from blockzoo.data.errors import DatasetError
from blockzoo.data.tokenizer import BYTE, TOKENIZER_FILE, ByteTokenizer, FileTokenizer, Tokenizer

FORMAT = "blockzoo-tokens"
VERSION = 2  # 2: the shard list; 1: one pair of files named after the prefix
# dtype name -> (array typecode, bytes per item)
TOKEN_DTYPES = {"uint8": ("B", 1), "uint16": ("H", 2), "uint32": ("I", 4)}
INDEX_TYPECODE = "q"  # int64
INDEX_ITEM_SIZE = 8
TEMPORARY_SUFFIX = ".tmp"


@attrs.frozen
class ShardFiles:
    """The two files of one shard: `stem.bin` and `stem.idx`."""

    stem: Path

    @property
    def name(self) -> str:
        return self.stem.name

    @property
    def tokens(self) -> Path:
        return self.stem.with_name(self.stem.name + ".bin")

    @property
    def index(self) -> Path:
        return self.stem.with_name(self.stem.name + ".idx")


@attrs.frozen
class DatasetFiles:
    prefix: Path

    @property
    def tokens(self) -> Path:
        """The token file of a dataset of one shard."""
        return self.prefix.with_name(self.prefix.name + ".bin")

    @property
    def index(self) -> Path:
        """The index file of a dataset of one shard."""
        return self.prefix.with_name(self.prefix.name + ".idx")

    @property
    def metadata(self) -> Path:
        return self.prefix.with_name(self.prefix.name + ".json")

    @property
    def tokenizer(self) -> Path:
        return self.prefix.with_name(self.prefix.name + ".tokenizer.json")

    def shard(self, name: str) -> ShardFiles:
        return ShardFiles(self.prefix.with_name(name))

    def shard_name(self, number: int, count: int) -> str:
        """The name of shard `number` of `count`."""
        return self.prefix.name if count == 1 else f"{self.prefix.name}.{number:05d}"

    def shards(self, metadata: dict[str, Any]) -> list[ShardFiles]:
        return [self.shard(shard["name"]) for shard in metadata["shards"]]


def token_dtype(vocab_size: int) -> str:
    """The smallest unsigned dtype that holds every id of a vocabulary."""
    for name, (_, size) in TOKEN_DTYPES.items():
        if vocab_size <= 2 ** (8 * size):
            return name
    raise DatasetError(f"a vocabulary of {vocab_size} ids does not fit 32-bit token ids")


def temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}{TEMPORARY_SUFFIX}")


# ---------------------------------------------------------------------------------------------------------------------
# Writing


class ShardWriter:
    """Streams documents (lists of token ids) to a shard's temporary files; memory does not grow with the shard.
    `close()` leaves them under their temporary names (`finish_dataset` puts them in place); `discard()` removes
    them."""

    FLUSH_TOKENS = 1 << 20
    FLUSH_DOCUMENTS = 1 << 16

    def __init__(self, files: ShardFiles, dtype: str):
        self.files = files
        self.dtype = dtype
        self.num_documents = 0
        self.num_tokens = 0
        self._typecode = TOKEN_DTYPES[dtype][0]
        self._tokens = array.array(self._typecode)
        self._offsets = array.array(INDEX_TYPECODE, [0])
        files.stem.parent.mkdir(parents=True, exist_ok=True)
        self._tokens_file = open(temporary(files.tokens), "wb")  # noqa: SIM115 - closed by close()
        self._index_file = open(temporary(files.index), "wb")  # noqa: SIM115 - closed by close()

    def add(self, ids: Sequence[int]) -> None:
        """Add a document (at least one token)."""
        if not ids:
            raise ValueError("a document needs at least one token")
        self._tokens.extend(ids)
        self.num_tokens += len(ids)
        self.num_documents += 1
        self._offsets.append(self.num_tokens)
        if len(self._tokens) >= self.FLUSH_TOKENS or len(self._offsets) >= self.FLUSH_DOCUMENTS:
            self._flush()

    def _flush(self) -> None:
        self._tokens.tofile(self._tokens_file)
        self._offsets.tofile(self._index_file)
        self._tokens = array.array(self._typecode)
        self._offsets = array.array(INDEX_TYPECODE)

    def close(self) -> None:
        if not self._tokens_file.closed:
            self._flush()
            self._tokens_file.close()
            self._index_file.close()

    def discard(self) -> None:
        self._tokens_file.close()
        self._index_file.close()
        for path in (self.files.tokens, self.files.index):
            temporary(path).unlink(missing_ok=True)

    def summary(self) -> dict[str, Any]:
        return {"name": self.files.name, "num_documents": self.num_documents, "num_tokens": self.num_tokens}


def begin_dataset(files: DatasetFiles) -> None:
    """Before writing a dataset: remove the temporaries an interrupted writer of this prefix left."""
    files.prefix.parent.mkdir(parents=True, exist_ok=True)
    for path in _own_files(files, temporaries=True):
        path.unlink(missing_ok=True)


def finish_dataset(
    files: DatasetFiles, tokenizer: Tokenizer, shards: Sequence[dict[str, Any]], sources: Sequence[str]
) -> dict[str, Any]:
    """Once every shard is written (closed, under its temporary names): remove the older dataset's completion marker,
    put the shards and the tokenizer's copy in place, write the metadata (last, atomically: the dataset is now
    complete), then remove the files of the older dataset that the new one does not use. Returns the metadata."""
    dtype = token_dtype(tokenizer.vocab_size)
    metadata = {
        "format": FORMAT,
        "version": VERSION,
        "dtype": dtype,
        "vocab_size": tokenizer.vocab_size,
        "eod_token_id": tokenizer.eod_token_id,
        "num_documents": sum(shard["num_documents"] for shard in shards),
        "num_tokens": sum(shard["num_tokens"] for shard in shards),
        "tokenizer": tokenizer.to_metadata(),
        "sources": list(sources),
        "shards": [dict(shard) for shard in shards],
    }
    files.metadata.unlink(missing_ok=True)
    for shard in files.shards(metadata):
        os.replace(temporary(shard.tokens), shard.tokens)
        os.replace(temporary(shard.index), shard.index)
    if isinstance(tokenizer, FileTokenizer):
        shutil.copyfile(tokenizer.path, temporary(files.tokenizer))
        os.replace(temporary(files.tokenizer), files.tokenizer)
    else:
        files.tokenizer.unlink(missing_ok=True)  # a tokenizer copied for an earlier dataset of this prefix
    temporary(files.metadata).write_text(json.dumps(metadata, indent=2) + "\n")
    os.replace(temporary(files.metadata), files.metadata)
    used = {path for shard in files.shards(metadata) for path in (shard.tokens, shard.index)}
    for path in _own_files(files, temporaries=False):
        if path not in used:
            path.unlink(missing_ok=True)
    return metadata


def _own_files(files: DatasetFiles, *, temporaries: bool) -> list[Path]:
    """The shard files (or their temporaries) a writer of this prefix may have left: `P.bin`, `P.00003.idx`, ..."""
    name = re.escape(files.prefix.name)
    shard = rf"{name}(\.\d{{5}})?\.(bin|idx)"
    pattern = re.compile(rf"\.({shard}|{name}\.(json|tokenizer\.json)){re.escape(TEMPORARY_SUFFIX)}" if temporaries
                         else shard)  # fmt: skip
    directory = files.prefix.parent
    return [directory / entry for entry in os.listdir(directory) if pattern.fullmatch(entry)]


class DatasetWriter:
    """Writes documents to a dataset of one shard. Use as a context manager: on a clean exit it puts the dataset in
    place (replacing one of the same prefix); on an exception it removes what it wrote."""

    def __init__(self, prefix: str | Path, tokenizer: Tokenizer, sources: Sequence[str] = ()):
        self.files = DatasetFiles(Path(prefix))
        self.tokenizer = tokenizer
        self.sources = list(sources)
        self.dtype = token_dtype(tokenizer.vocab_size)
        begin_dataset(self.files)
        self._shard = ShardWriter(self.files.shard(self.files.shard_name(0, 1)), self.dtype)

    @property
    def num_documents(self) -> int:
        return self._shard.num_documents

    @property
    def num_tokens(self) -> int:
        return self._shard.num_tokens

    def add(self, ids: Sequence[int]) -> None:
        """Add a document (at least one token)."""
        self._shard.add(ids)

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, kind: type | None, *_: Any) -> None:
        if kind is None:
            self._shard.close()
            finish_dataset(self.files, self.tokenizer, [self._shard.summary()], self.sources)
        else:
            self._shard.discard()


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
    """The metadata of a prepared dataset, checked: every problem is a DatasetError naming the file. A dataset of
    format version 1 gets the shard list of its one shard."""
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
    if metadata["tokenizer"].get("type") not in (BYTE, TOKENIZER_FILE):
        raise DatasetError(f"{path}: unknown tokenizer {metadata['tokenizer']!r}")
    if metadata["version"] < 2:
        metadata["shards"] = [
            {
                "name": files.prefix.name,
                "num_documents": metadata["num_documents"],
                "num_tokens": metadata["num_tokens"],
            }
        ]
    _check_shards(path, metadata)
    return metadata


def _check_shards(path: Path, metadata: dict[str, Any]) -> None:
    shards = metadata.get("shards")
    if not isinstance(shards, list) or not shards:
        raise DatasetError(f"the dataset metadata {path} has no valid 'shards' list (got {shards!r})")
    for number, shard in enumerate(shards):
        valid = (
            isinstance(shard, dict)
            and isinstance(shard.get("name"), str)
            and shard["name"] not in ("", ".", "..")
            and "/" not in shard["name"]
            and os.sep not in shard["name"]
            and all(type(shard.get(key)) is int and shard[key] >= 0 for key in ("num_documents", "num_tokens"))
        )
        if not valid:
            raise DatasetError(
                f"the dataset metadata {path}: shard {number} is not "
                f'{{"name": <a file name>, "num_documents": <count>, "num_tokens": <count>}} (got {shard!r})'
            )
    for key in ("num_documents", "num_tokens"):
        if sum(shard[key] for shard in shards) != metadata[key]:
            raise DatasetError(f"the dataset metadata {path}: the shards' {key} do not add up to its {key!r}")


def tokenizer_of(files: DatasetFiles, metadata: dict[str, Any]) -> Tokenizer:
    """The tokenizer a dataset was prepared with."""
    if metadata["tokenizer"]["type"] == TOKENIZER_FILE:
        return FileTokenizer(files.tokenizer, metadata["tokenizer"].get("eod_token"))
    return ByteTokenizer()
