"""The `blended` dataset: several datasets (the *sources*) mixed in fixed proportions.

The blend's sample i is one source's next sample: the source whose count so far lags its share × (i + 1) the most
(ties: the first listed), the deterministic greedy of Megatron's blending. In integers (weights as the fractions the
config wrote, over a common denominator) this is the smooth weighted round robin: every prefix of the stream holds
each source's share within one sample, and exactly its share after each whole period (the weights' sum). The index
depends on the weights alone: not on the seed, the rank or the layout, so the global sample order stays a function of
the sample number, as for every dataset, and a resumed run continues it (the position is the sample number).

The index is computed lazily in chunks, sequentially from the start: a resumed run walks the chunks before its
position once (about 0.3 µs a sample: a fraction of a second per million); the sources' counts at each chunk start
are kept (a few integers each), the assignments of the last few chunks only.
"""

from __future__ import annotations

import array
import hashlib
from collections import OrderedDict
from fractions import Fraction
from math import lcm
from typing import Any

import attrs

from blockzoo.data.config import BlendedDatasetConfig, BlendSourceConfig, MemmapDatasetConfig
from blockzoo.data.dataset import Dataset, Sample, _next_sample, build_dataset
from blockzoo.data.errors import DatasetError
from blockzoo.data.tokenizer import TOKENIZER_FILE, ByteTokenizer, FileTokenizer, Tokenizer


class BlendIndex:
    """Which source each sample of a blend comes from, and that sample's number within its source."""

    CHUNK = 1 << 16
    CACHED_CHUNKS = 4

    def __init__(self, weights: list[float]):
        # The fractions as written (0.7 is 7/10, not the nearest double), so shares are exact over a period.
        fractions = [Fraction(repr(float(weight))) for weight in weights]
        denominator = lcm(*(fraction.denominator for fraction in fractions))
        self.weights = [int(fraction * denominator) for fraction in fractions]
        self.period = sum(self.weights)
        self.chunk = self.CHUNK
        # counts at the start of chunk k (k < len): the SWRR state, `current`, follows from them and k.
        self._starts: list[list[int]] = [[0] * len(weights)]
        self._chunks: OrderedDict[int, tuple[bytes, array.array]] = OrderedDict()

    def locate(self, index: int) -> tuple[int, int]:
        """(source, the sample's number within that source) of blend sample `index`."""
        chunk, offset = divmod(index, self.chunk)
        sources, within = self._chunk(chunk)
        return sources[offset], within[offset]

    def counts(self, samples: int) -> list[int]:
        """How many of the first `samples` samples each source gave."""
        chunk, offset = divmod(samples, self.chunk)
        sources, _ = self._chunk(chunk)
        return [start + sources.count(source, 0, offset) for source, start in enumerate(self._starts[chunk])]

    def _chunk(self, chunk: int) -> tuple[bytes, array.array]:
        if chunk in self._chunks:
            self._chunks.move_to_end(chunk)
            return self._chunks[chunk]
        while len(self._starts) <= chunk:  # the counts at each chunk start, from the last known one
            self._compute(len(self._starts) - 1)
        computed = self._compute(chunk)
        self._chunks[chunk] = computed
        while len(self._chunks) > self.CACHED_CHUNKS:
            self._chunks.popitem(last=False)
        return computed

    def _compute(self, chunk: int) -> tuple[bytes, array.array]:
        weights, period = self.weights, self.period
        counts = list(self._starts[chunk])
        first = chunk * self.chunk
        # The greedy's lag of each source before sample `first`, times the period: weight × first - count × period.
        current = [weight * first - count * period for weight, count in zip(weights, counts)]
        order = range(len(weights))
        sources = bytearray(self.chunk)
        within = array.array("q", bytes(8 * self.chunk))
        for offset in range(self.chunk):
            best, best_lag = 0, None
            for source in order:
                lag = current[source] + weights[source]
                current[source] = lag
                if best_lag is None or lag > best_lag:
                    best, best_lag = source, lag
            current[best] -= period
            sources[offset] = best
            within[offset] = counts[best]
            counts[best] += 1
        if len(self._starts) == chunk + 1:
            self._starts.append(counts)
        return bytes(sources), within


class BlendedDataset(Dataset):
    evaluation_hint = "hold out documents of a source (its validation_fraction, in data.sources)"

    def __init__(self, config: BlendedDatasetConfig, *, seed: int, model_vocab_size: int | None = None):
        super().__init__(config, seed=seed)
        self.names = list(config.sources)
        self.sources = [
            _build_source(name, source, config, seed, model_vocab_size) for name, source in config.sources.items()
        ]
        self.vocab_size, self.tokenizer = _common_tokenizer(self.names, self.sources)
        self.index = BlendIndex([source.weight for source in config.sources.values()])
        self._epoch_sizes = [source.num_training_samples for source in self.sources]
        self._said_read_whole: set[int] = set()
        # The evaluation split: the sources holding out samples, blended by their weights.
        self._evaluated = [i for i, source in enumerate(self.sources) if source.num_evaluation_samples != 0]
        self._evaluation_index = (
            BlendIndex([config.sources[self.names[i]].weight for i in self._evaluated]) if self._evaluated else None
        )
        self._num_evaluation_samples = self._count_evaluation_samples()

    @property
    def num_training_samples(self) -> int | None:
        sizes = self._epoch_sizes
        return None if None in sizes else sum(sizes)

    @property
    def num_evaluation_samples(self) -> int | None:
        return self._num_evaluation_samples

    def training_sample(self, index: int) -> Sample:
        source, within = self.index.locate(index)
        size = self._epoch_sizes[source]
        if size is not None and within >= size and source not in self._said_read_whole:
            self._said_read_whole.add(source)
            self.log(
                f"data source {self.names[source]!r} has been read whole ({size} training sequences): it is read "
                f"again, in a new order (now in its epoch {within // size + 1}; said once per source)"
            )
        return self.sources[source].training_sample(within)

    def evaluation_sample(self, index: int) -> Sample:
        if self._evaluation_index is None or (
            self._num_evaluation_samples is not None and not 0 <= index < self._num_evaluation_samples
        ):
            raise IndexError(f"evaluation sample {index} of {self._num_evaluation_samples}")
        source, within = self._evaluation_index.locate(index)
        return self.sources[self._evaluated[source]].evaluation_sample(within)

    def source_tokens(self, position: dict[str, Any] | None) -> dict[str, int]:
        counts = self.index.counts(_next_sample(position))
        length = self.config.sequence_length
        return {name: count * length for name, count in zip(self.names, counts)}

    def _count_evaluation_samples(self) -> int | None:
        """Up to the first evaluated source that runs out; None when none ever does (generated data)."""
        if self._evaluation_index is None:
            return 0
        sizes = [self.sources[i].num_evaluation_samples for i in self._evaluated]
        if all(size is None for size in sizes):
            return None
        index = 0
        while True:  # bounded by the sum of the finite sizes
            source, within = self._evaluation_index.locate(index)
            if sizes[source] is not None and within >= sizes[source]:
                return index
            index += 1


def _build_source(
    name: str, source: BlendSourceConfig, blend: BlendedDatasetConfig, seed: int, model_vocab_size: int | None
) -> Dataset:
    """The source's dataset, with the blend's sequence length and micro-batch size; its problems name it."""
    shape = {"sequence_length": blend.sequence_length, "micro_batch_size": blend.micro_batch_size}
    if source.dataset is not None:
        config = attrs.evolve(source.dataset, **shape)
        where = f"sources.{name}.dataset"
    else:
        config = MemmapDatasetConfig(path=source.path, validation_fraction=source.validation_fraction, **shape)
        where = f"sources.{name}.path ({source.path})"
    try:
        dataset = build_dataset(config, seed=seed, model_vocab_size=model_vocab_size)
    except DatasetError as error:
        raise DatasetError(f"blended data source {name!r} ({where}): {error}") from None
    if dataset.num_training_samples == 0:
        raise DatasetError(f"blended data source {name!r} ({where}) holds no training samples")
    return dataset


def _common_tokenizer(names: list[str], sources: list[Dataset]) -> tuple[int, Tokenizer | None]:
    """The vocabulary size and tokenizer every source shares; sources that differ are refused, naming them."""
    identities = [_tokenizer_identity(source) for source in sources]
    for name, (identity, description) in zip(names[1:], identities[1:]):
        if identity != identities[0][0]:
            raise DatasetError(
                f"the blended data sources {names[0]!r} and {name!r} do not share a tokenizer: {names[0]!r} has "
                f"{identities[0][1]}, {name!r} has {description}; prepare every source with one tokenizer"
            )
    return sources[0].vocab_size, sources[0].tokenizer


def _tokenizer_identity(dataset: Dataset) -> tuple[tuple, str]:
    """What makes two datasets tokenize alike (the tokenizer's kind and content, the vocabulary size), and its
    description for a message."""
    tokenizer = dataset.tokenizer
    vocabulary = f"{dataset.vocab_size} token ids"
    if tokenizer is None:
        return ("none", dataset.vocab_size), f"no tokenizer, {vocabulary}"
    if isinstance(tokenizer, ByteTokenizer):
        return ("byte", dataset.vocab_size), f"the byte tokenizer, {vocabulary}"
    if isinstance(tokenizer, FileTokenizer):  # a copy of one tokenizer.json per prepared dataset: by content
        digest = hashlib.sha256(tokenizer.path.read_bytes()).hexdigest()
        eod = f", end of document {tokenizer.eod_token!r}" if tokenizer.eod_token is not None else ""
        identity = (TOKENIZER_FILE, digest, tokenizer.eod_token, dataset.vocab_size)
        return identity, f"the tokenizer {tokenizer.path} (sha256 {digest[:12]}{eod}), {vocabulary}"
    return (type(tokenizer).__qualname__, dataset.vocab_size), f"a {type(tokenizer).__name__}, {vocabulary}"
