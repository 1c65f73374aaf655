"""The `random` dataset: uniformly random tokens in documents of random lengths, for benchmarks. No files."""

from __future__ import annotations

import math

import torch

from blockzoo.data.config import RandomDatasetConfig
from blockzoo.data.dataset import Dataset, Sample, generator
from blockzoo.data.errors import DatasetError


class RandomDataset(Dataset):
    """Sample `i` of a split is drawn from a generator seeded with (seed, split, i): any sample can be made
    alone, in any process. Both splits are endless."""

    num_evaluation_samples = None

    def __init__(self, config: RandomDatasetConfig, *, seed: int, model_vocab_size: int | None = None):
        super().__init__(config, seed=seed)
        vocab_size = config.vocab_size if config.vocab_size is not None else model_vocab_size
        if vocab_size is None:
            raise DatasetError("the random dataset needs data.vocab_size when no model gives its vocabulary size")
        self.vocab_size = vocab_size
        self._max_length = config.max_document_length or config.sequence_length

    def training_sample(self, index: int) -> Sample:
        return self._sample("training", index)

    def evaluation_sample(self, index: int) -> Sample:
        return self._sample("evaluation", index)

    def _sample(self, split: str, index: int) -> Sample:
        random = generator(self.seed, split, index)
        length = self.config.sequence_length
        minimum = self.config.min_document_length
        # Enough document lengths to fill the sequence; the last one used is cut to fit.
        draws = torch.randint(minimum, self._max_length + 1, (math.ceil(length / minimum),), generator=random)
        ends = draws.cumsum(0)
        used = int(torch.searchsorted(ends, torch.tensor(length))) + 1
        lengths = draws[:used].tolist()
        lengths[-1] = length - (int(ends[used - 2]) if used > 1 else 0)
        tokens = torch.randint(0, self.vocab_size, (length,), generator=random)
        return Sample(tokens, lengths)
