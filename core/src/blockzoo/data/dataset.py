"""Datasets of packed documents: micro-batches, deterministic sampling, data-parallel sharding, resumption.

A *sample* is one sequence of `sequence_length` tokens, a window of a stream of documents, with the lengths of
the document pieces it holds. Samples are numbered; sample `i` depends only on the seed and `i`. The global
order is split across data-parallel ranks: rank `r` of `n` takes samples `r, r + n, r + 2n, ...`, and each
micro-batch packs `micro_batch_size` of them. The position of the training stream is the number of samples
all ranks together have consumed, so a run resumes from it (even with another data-parallel size).

Every tensor-parallel and sequence-data-parallel rank of one data-parallel group reads the same batches: pass
the *data-parallel* rank and size.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import attrs
import torch

from blockzoo.data.config import DatasetConfig
from blockzoo.data.errors import DatasetError
from blockzoo.data.tokenizer import Tokenizer
from blockzoo.layers.base import IGNORE_INDEX
from blockzoo.plugins import get_registry


class Sample(NamedTuple):
    tokens: torch.Tensor  # int64 [sequence_length]
    lengths: list[int]  # the document pieces of the sequence, in order, each >= 1, summing to sequence_length


@attrs.frozen
class MicroBatch:
    """Packed sequences: `tokens` and `labels` are int64 `[micro_batch_size * sequence_length]`; `lengths` (int64)
    are the document pieces in order, what `blockzoo.layers.base.Batch(lengths)` takes. A label is the next token
    of the same document, or IGNORE_INDEX (-100)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def pack(cls, samples: Sequence[Sample]) -> MicroBatch:
        tokens = torch.cat([sample.tokens for sample in samples])
        lengths = torch.tensor([length for sample in samples for length in sample.lengths], dtype=torch.int64)
        labels = torch.full_like(tokens, IGNORE_INDEX)
        labels[:-1] = tokens[1:]
        labels[lengths.cumsum(0) - 1] = IGNORE_INDEX  # the last token of each piece
        return cls(tokens=tokens, labels=labels, lengths=lengths)

    def to(self, device: torch.device | str) -> MicroBatch:
        return MicroBatch(tokens=self.tokens.to(device), labels=self.labels.to(device), lengths=self.lengths)


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed from parts (seed, stream name, index...), the same in every process and on every platform."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def generator(*parts: Any) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(*parts))


class Dataset:
    """Base of the dataset implementations: a subclass provides `vocab_size`, the samples of its two splits, and
    how many evaluation samples there are; this class batches and shards them.

    Built as `Impl(config, *, seed, model_vocab_size)` (see `build_dataset`).
    """

    vocab_size: int
    tokenizer: Tokenizer | None = None  # to decode generated tokens; None when the data has no text
    # Where a dataset says what the run should know (a source read whole, ...); `build_dataset(log=...)` sets it.
    logger: Callable[[str], None] | None = None
    # How to make the evaluation split larger, said when it is too small.
    evaluation_hint = "raise data.validation_fraction"

    def __init__(self, config: DatasetConfig, *, seed: int):
        self.config = config
        self.seed = seed

    def log(self, message: str) -> None:
        if self.logger is not None:
            self.logger(message)

    @property
    def num_training_samples(self) -> int | None:
        """Samples in one epoch of the training split (0: the dataset is for evaluation only); None when the
        training stream is generated without end."""
        return None

    def source_tokens(self, position: dict[str, Any] | None) -> dict[str, int] | None:
        """Tokens trained so far from each source of a dataset that mixes several, at a training `position` (as
        `TrainingBatches.position()`); None for a dataset of one source."""
        return None

    def training_sample(self, index: int) -> Sample:
        raise NotImplementedError

    def evaluation_sample(self, index: int) -> Sample:
        raise NotImplementedError

    @property
    def num_evaluation_samples(self) -> int | None:
        """Samples in the evaluation split; None when it never ends (generated data)."""
        raise NotImplementedError

    def training_batches(
        self, *, rank: int = 0, ranks: int = 1, position: dict[str, Any] | None = None
    ) -> TrainingBatches:
        """The endless training stream of data-parallel rank `rank` of `ranks`, from `position` (the start if None)."""
        _check_rank(rank, ranks)
        return TrainingBatches(self, rank, ranks, _next_sample(position))

    def evaluation_batches(self, *, rank: int = 0, ranks: int = 1) -> Iterator[MicroBatch]:
        """The evaluation split from its start, in order. Every rank gets the same number of micro-batches; the
        samples left over for a last, incomplete round are not used. Endless for generated data."""
        _check_rank(rank, ranks)
        per_round = self.config.micro_batch_size * ranks
        total = self.num_evaluation_samples
        if total is not None and total < per_round:
            raise DatasetError(
                f"the evaluation split holds {total} sequences of {self.config.sequence_length} tokens, fewer than "
                f"one micro-batch on each of {ranks} data-parallel ranks ({per_round}); "
                f"{self.evaluation_hint} or lower data.micro_batch_size"
            )
        starts = itertools.count(0, per_round) if total is None else range(0, total - per_round + 1, per_round)
        return (_micro_batch(self, self.evaluation_sample, start, rank, ranks) for start in starts)


class TrainingBatches(Iterator[MicroBatch]):
    """An endless iterator of training micro-batches. `position()` is the plain dict to store in a checkpoint and
    pass back to `Dataset.training_batches` to continue after the last batch taken."""

    def __init__(self, dataset: Dataset, rank: int, ranks: int, next_sample: int):
        self.dataset = dataset
        self.rank = rank
        self.ranks = ranks
        self._next_sample = next_sample

    def position(self) -> dict[str, int]:
        return {"next_sample": self._next_sample}

    def __next__(self) -> MicroBatch:
        batch = _micro_batch(self.dataset, self.dataset.training_sample, self._next_sample, self.rank, self.ranks)
        self._next_sample += self.dataset.config.micro_batch_size * self.ranks
        return batch


def _micro_batch(dataset: Dataset, sample: Callable[[int], Sample], start: int, rank: int, ranks: int) -> MicroBatch:
    """Rank `rank`'s micro-batch of the round of samples from `start`: samples start + i * ranks + rank."""
    return MicroBatch.pack([sample(start + i * ranks + rank) for i in range(dataset.config.micro_batch_size)])


def _check_rank(rank: int, ranks: int) -> None:
    if not (isinstance(ranks, int) and isinstance(rank, int) and ranks >= 1 and 0 <= rank < ranks):
        raise ValueError(f"data-parallel rank {rank!r} of {ranks!r}: need 0 <= rank < ranks")


def _next_sample(position: dict[str, Any] | None) -> int:
    if position is None:
        return 0
    if (
        not isinstance(position, dict)
        or set(position) != {"next_sample"}
        or not isinstance(position["next_sample"], int)
        or isinstance(position["next_sample"], bool)
        or position["next_sample"] < 0
    ):
        raise DatasetError(f"bad data position {position!r}: expected {{'next_sample': <integer >= 0>}}")
    return position["next_sample"]


# ---------------------------------------------------------------------------------------------------------------------
# Datasets of stored documents (memmap files, the embedded corpus)


@attrs.frozen
class TokenStore:
    """Documents as one token tensor and their offsets: document d is `tokens[offsets[d]:offsets[d + 1]]`."""

    tokens: torch.Tensor  # 1-D, any integer dtype, possibly memory-mapped
    offsets: torch.Tensor  # int64 [documents + 1], from 0 to len(tokens), increasing
    vocab_size: int
    source: str  # names the data in messages

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1


class StoredDataset(Dataset):
    """Samples are non-overlapping windows of a stored stream of documents (in stored order).

    The last `validation_fraction` of the documents (at least one when the fraction is not 0) are the
    evaluation split, read in order; the others are the training split, whose windows are visited in a new
    random order each epoch. Tokens after the last whole window of a split are not used.
    """

    def __init__(self, config: DatasetConfig, store: TokenStore, *, seed: int, validation_fraction: float):
        super().__init__(config, seed=seed)
        self.store = store
        self.vocab_size = store.vocab_size
        length = config.sequence_length
        documents = store.num_documents
        held_out = 0 if validation_fraction == 0 else max(1, round(validation_fraction * documents))
        # A fraction of 1 holds every document out: a dataset for evaluation only (training from it is refused by
        # `build_dataset`).
        if held_out >= documents and validation_fraction < 1:
            raise DatasetError(
                f"{store.source} holds {documents} documents: none is left for training after holding out "
                f"{held_out} for evaluation (validation_fraction {validation_fraction})"
            )
        split = int(store.offsets[documents - held_out])
        self._training_windows = split // length
        self._evaluation_start = split
        self._evaluation_windows = (len(store.tokens) - split) // length
        if self._training_windows == 0 and validation_fraction < 1:
            raise DatasetError(
                f"the training split of {store.source} holds {split} tokens, fewer than one sequence of {length}; "
                "lower data.sequence_length or use more data"
            )
        self._permutation_epoch = -1
        self._permutation = torch.empty(0, dtype=torch.int64)

    @property
    def num_evaluation_samples(self) -> int:
        return self._evaluation_windows

    @property
    def num_training_samples(self) -> int:
        return self._training_windows

    def training_sample(self, index: int) -> Sample:
        if self._training_windows == 0:
            raise DatasetError(f"{self.store.source} holds no training data: every document is held out")
        epoch, within = divmod(index, self._training_windows)
        if epoch != self._permutation_epoch:
            generated = generator(self.seed, "training", epoch)
            self._permutation = torch.randperm(self._training_windows, generator=generated)
            self._permutation_epoch = epoch
        return self._window(0, int(self._permutation[within]))

    def evaluation_sample(self, index: int) -> Sample:
        if not 0 <= index < self._evaluation_windows:
            raise IndexError(f"evaluation sample {index} of {self._evaluation_windows}")
        return self._window(self._evaluation_start, index)

    def _window(self, split_start: int, window: int) -> Sample:
        length = self.config.sequence_length
        start = split_start + window * length
        end = start + length
        tokens = self.store.tokens[start:end].to(torch.int64)
        if int(tokens.max()) >= self.vocab_size:
            raise DatasetError(
                f"{self.store.source}: token id {int(tokens.max())} among tokens [{start}, {end}) is outside the "
                f"vocabulary of {self.vocab_size} ids; the token file is corrupt"
            )
        offsets = self.store.offsets
        first = int(torch.searchsorted(offsets, torch.tensor(start), right=True))  # first offset > start
        last = int(torch.searchsorted(offsets, torch.tensor(end)))  # first offset >= end
        edges = [start, *offsets[first:last].tolist(), end]
        return Sample(tokens, [b - a for a, b in itertools.pairwise(edges)])


# ---------------------------------------------------------------------------------------------------------------------


def build_dataset(
    config: DatasetConfig,
    *,
    seed: int,
    model_vocab_size: int | None = None,
    log: Callable[[str], None] | None = None,
    training: bool = True,
) -> Dataset:
    """The dataset a config describes, through the registry (plugins may add dataset types).

    `seed`: the run's seed, used when `config.seed` is None. `model_vocab_size`: the model's vocabulary; a
    dataset with more token ids is refused (and the `random` type draws from it by default). `log`: where the
    dataset reports what the run should know. `training`: a dataset without training samples (every document
    held out) is refused; False for an evaluation set.
    """
    registry = get_registry()
    implementation = registry.resolve("dataset", registry.name_of(type(config))).load_implementation()
    seed = seed if config.seed is None else config.seed
    dataset = implementation(config, seed=seed, model_vocab_size=model_vocab_size)
    dataset.logger = log
    if training and dataset.num_training_samples == 0:
        raise DatasetError(
            "the data holds no training samples: validation_fraction 1 holds every document out, which makes a "
            "dataset for evaluation only (training.evaluation.datasets); lower validation_fraction"
        )
    if model_vocab_size is not None and dataset.vocab_size > model_vocab_size:
        raise DatasetError(
            f"the data uses {dataset.vocab_size} token ids, more than the model's vocabulary "
            f"(model.embeddings.vocab_size = {model_vocab_size}); raise it to at least {dataset.vocab_size}"
        )
    return dataset
