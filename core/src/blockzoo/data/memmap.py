"""The `memmap` dataset: files written by `blockzoo prepare`, memory-mapped (see `storage` for the layout)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from blockzoo.data.config import MemmapDatasetConfig
from blockzoo.data.dataset import StoredDataset, TokenStore
from blockzoo.data.errors import DatasetError
from blockzoo.data.storage import INDEX_ITEM_SIZE, TOKEN_DTYPES, DatasetFiles, read_metadata, tokenizer_of
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
    """Memory-map the token and index files, checked against the metadata and each other."""
    num_tokens, num_documents = metadata["num_tokens"], metadata["num_documents"]
    if num_documents < 1:
        raise DatasetError(f"the dataset {files.prefix} holds no documents ({files.metadata})")
    dtype = metadata["dtype"]
    _check_size(files.tokens, num_tokens * TOKEN_DTYPES[dtype][1], f"{num_tokens} {dtype} tokens")
    _check_size(files.index, (num_documents + 1) * INDEX_ITEM_SIZE, f"{num_documents + 1} int64 document offsets")
    tokens = torch.from_file(str(files.tokens), shared=False, size=num_tokens, dtype=getattr(torch, dtype))
    offsets = torch.from_file(str(files.index), shared=False, size=num_documents + 1, dtype=torch.int64)
    if int(offsets[0]) != 0 or int(offsets[-1]) != num_tokens or not bool((offsets[1:] > offsets[:-1]).all()):
        raise DatasetError(
            f"the index {files.index} does not match the tokens: its offsets must rise from 0 to {num_tokens} "
            f"(the number of tokens), every document at least one token long"
        )
    return TokenStore(tokens=tokens, offsets=offsets, vocab_size=metadata["vocab_size"], source=str(files.prefix))


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
