"""The `memmap` dataset: files written by `blockzoo prepare`, memory-mapped (see `storage` for the layout)."""

from __future__ import annotations

import bisect
import functools
import itertools
from pathlib import Path

import torch

from blockzoo.data.config import MemmapDatasetConfig
from blockzoo.data.dataset import StoredDataset, TokenStore
from blockzoo.data.errors import DatasetError
from blockzoo.data.storage import (
    INDEX_ITEM_SIZE,
    TOKEN_DTYPES,
    DatasetFiles,
    ShardFiles,
    read_metadata,
    tokenizer_of,
)
from blockzoo.data.tokenizer import Tokenizer


class MemmapDataset(StoredDataset):
    def __init__(self, config: MemmapDatasetConfig, *, seed: int, model_vocab_size: int | None = None):
        if config.path is None:
            raise DatasetError(
                "the memmap dataset has no path: set data.path to the prefix written by `blockzoo prepare` "
                "(e.g. data/tokens)"
            )
        self.files = DatasetFiles(Path(config.path))
        self.metadata = read_metadata(self.files)
        store = open_store(self.files, self.metadata)
        super().__init__(config, store, seed=seed, validation_fraction=config.validation_fraction)

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """Loaded on first use: training does not need it (nor the `tokenizers` package)."""
        return tokenizer_of(self.files, self.metadata)


def open_store(files: DatasetFiles, metadata: dict) -> TokenStore:
    """Memory-map every shard's token and index files, each checked against the metadata and against each other;
    the shards' documents in order are one stream."""
    num_tokens, num_documents = metadata["num_tokens"], metadata["num_documents"]
    if num_documents < 1:
        raise DatasetError(f"the dataset {files.prefix} holds no documents ({files.metadata})")
    shards = [_open_shard(files.shard(shard["name"]), shard, metadata["dtype"]) for shard in metadata["shards"]]
    if len(shards) == 1:
        tokens, offsets = shards[0]
    else:
        starts = itertools.accumulate((len(shard_tokens) for shard_tokens, _ in shards[:-1]), initial=0)
        offsets = torch.cat(
            [shard_offsets[:-1] + start for (_, shard_offsets), start in zip(shards, starts, strict=True)]
            + [torch.tensor([num_tokens])]
        )
        tokens = ShardedTokens([shard_tokens for shard_tokens, _ in shards])
    return TokenStore(tokens=tokens, offsets=offsets, vocab_size=metadata["vocab_size"], source=str(files.prefix))


def _open_shard(shard: ShardFiles, entry: dict, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_documents = entry["num_tokens"], entry["num_documents"]
    _check_size(shard.tokens, num_tokens * TOKEN_DTYPES[dtype][1], f"{num_tokens} {dtype} tokens")
    _check_size(shard.index, (num_documents + 1) * INDEX_ITEM_SIZE, f"{num_documents + 1} int64 document offsets")
    if num_documents == 0:  # torch.from_file cannot map an empty file; a writer never lists an empty shard
        return torch.empty(0, dtype=getattr(torch, dtype)), torch.zeros(1, dtype=torch.int64)
    tokens = torch.from_file(str(shard.tokens), shared=False, size=num_tokens, dtype=getattr(torch, dtype))
    offsets = torch.from_file(str(shard.index), shared=False, size=num_documents + 1, dtype=torch.int64)
    if int(offsets[0]) != 0 or int(offsets[-1]) != num_tokens or not bool((offsets[1:] > offsets[:-1]).all()):
        raise DatasetError(
            f"the index {shard.index} does not match the tokens: its offsets must rise from 0 to {num_tokens} "
            f"(the number of tokens), every document at least one token long"
        )
    return tokens, offsets


class ShardedTokens:
    """The token files of several shards as one 1-D sequence: `len()` and slices (`tokens[a:b]`, a tensor) read
    across shard boundaries, so the datasets see one stream without the shards being copied into memory."""

    def __init__(self, shards: list[torch.Tensor]):
        self.shards = shards
        self.starts = list(itertools.accumulate((len(shard) for shard in shards), initial=0))
        self.dtype = shards[0].dtype

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, window: slice) -> torch.Tensor:
        if not isinstance(window, slice) or window.step not in (None, 1):
            raise TypeError("sharded tokens are read by contiguous slices (tokens[start:end])")
        start, end, _ = window.indices(len(self))
        end = max(start, end)
        first = bisect.bisect_right(self.starts, start) - 1
        pieces = []
        for shard, shard_start in zip(self.shards[first:], self.starts[first:], strict=False):
            if shard_start >= end:
                break
            pieces.append(shard[max(start - shard_start, 0) : end - shard_start])
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces) if pieces else self.shards[0][:0]


def _check_size(path: Path, expected: int, what: str) -> None:
    if not path.is_file():
        raise DatasetError(f"the dataset is incomplete: {path} does not exist")
    size = path.stat().st_size
    if size != expected:
        problem = "is truncated" if size < expected else "is longer than its metadata says"
        raise DatasetError(
            f"{path} {problem}: it holds {size} bytes, the metadata describes {what} ({expected} bytes); "
            "prepare the dataset again"
        )
