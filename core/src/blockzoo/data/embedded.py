"""The `embedded` dataset: the built-in story corpus (`corpus`), tokenized in memory with the byte tokenizer."""

from __future__ import annotations

import itertools

import torch

from blockzoo.data.config import EmbeddedDatasetConfig
from blockzoo.data.corpus import stories
from blockzoo.data.dataset import StoredDataset, TokenStore
from blockzoo.data.tokenizer import ByteTokenizer


class EmbeddedDataset(StoredDataset):
    def __init__(self, config: EmbeddedDatasetConfig, *, seed: int, model_vocab_size: int | None = None):
        super().__init__(
            config, embedded_store(config.num_documents), seed=seed, validation_fraction=config.validation_fraction
        )
        self.tokenizer = ByteTokenizer()


def embedded_store(num_documents: int) -> TokenStore:
    """The first `num_documents` stories, each followed by the byte tokenizer's end-of-document id."""
    tokenizer = ByteTokenizer()
    encoded = [story.encode("utf-8") for story in stories(num_documents)]
    offsets = torch.tensor([0, *itertools.accumulate(len(text) + 1 for text in encoded)], dtype=torch.int64)
    # The bytes with a placeholder after each story, widened so the end-of-document id (256) fits, then set.
    tokens = torch.frombuffer(bytearray(b"\0".join(encoded) + b"\0"), dtype=torch.uint8).to(torch.int16)
    tokens[offsets[1:] - 1] = tokenizer.eod_token_id
    return TokenStore(tokens=tokens, offsets=offsets, vocab_size=tokenizer.vocab_size, source="the embedded corpus")
