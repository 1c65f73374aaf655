"""Dataset configs (kind `dataset`, the `data:` section of a run). Torch-free.

Every dataset yields micro-batches of `micro_batch_size` sequences of `sequence_length` tokens, each
sequence a window of a packed stream of documents. Types: `memmap` (files written by `blockzoo prepare`),
`embedded` (a small built-in English-like corpus, for demos and tests), `random` (random tokens, for
benchmarks) and `blended` (several datasets mixed in fixed proportions).
"""

from __future__ import annotations

from typing import ClassVar

from blockzoo.config import Config, PolymorphicConfig, at_least, at_most, check, configclass, field, greater_than


@configclass
class DatasetConfig(PolymorphicConfig):
    """Where training and evaluation tokens come from. Kind `dataset`, default type `memmap`."""

    kind: ClassVar[str] = "dataset"
    default_type: ClassVar[str] = "memmap"

    sequence_length: int = field(
        2048, doc="Tokens in each sequence (a window of the packed documents).", validator=at_least(1)
    )
    micro_batch_size: int = field(
        1, doc="Sequences in each micro-batch of each data-parallel rank.", validator=at_least(1)
    )
    seed: int | None = field(None, doc="Seed of the sampling order. None: the run's seed (distributed.seed).")


def _check_fraction(instance: DatasetConfig, attribute, value: float) -> None:
    check(0 <= value <= 1, attribute.name, f"must be in [0, 1], got {value}")


_VALIDATION_FRACTION_DOC = (
    "Fraction of the documents (the last ones, in file order) held out for evaluation. 1: every document, a dataset "
    "for evaluation only (`training.evaluation.datasets`)."
)


@configclass
class MemmapDatasetConfig(DatasetConfig):
    """Token files written by `blockzoo prepare`: `PATH.bin` (tokens), `PATH.idx` (document offsets),
    `PATH.json` (tokenizer, vocabulary size, counts). The last `validation_fraction` of the documents, in
    file order, form the evaluation split; the rest is training data."""

    path: str | None = field(None, doc="The path prefix given to `blockzoo prepare --output`.")
    validation_fraction: float = field(0.0, doc=_VALIDATION_FRACTION_DOC, validator=_check_fraction)


@configclass
class EmbeddedDatasetConfig(DatasetConfig):
    """A built-in corpus of short English-like stories generated deterministically (no download), tokenized
    with the byte tokenizer. A tiny model learns its spelling and sentence patterns in minutes on a CPU."""

    num_documents: int = field(
        6000,
        doc="Stories in the corpus (about 500 bytes each, generated when the run starts: 100,000 take about 3 s), at "
        "most 1,000,000.",
        validator=[at_least(2), at_most(1_000_000)],
    )
    validation_fraction: float = field(0.05, doc=_VALIDATION_FRACTION_DOC, validator=_check_fraction)


@configclass
class RandomDatasetConfig(DatasetConfig):
    """Uniformly random tokens in documents of random lengths: no files, for benchmarks. The evaluation
    split is another random stream."""

    vocab_size: int | None = field(
        None, doc="Token ids are drawn from [0, vocab_size). None: the model's vocabulary size.", validator=at_least(1)
    )
    min_document_length: int = field(1, doc="Shortest document, in tokens.", validator=greater_than(0))
    max_document_length: int | None = field(
        None, doc="Longest document, in tokens. None: the sequence length.", validator=greater_than(0)
    )

    def __attrs_post_init__(self) -> None:
        if self.max_document_length is not None:
            check(
                self.max_document_length >= self.min_document_length,
                "max_document_length",
                f"must be >= min_document_length ({self.min_document_length}), got {self.max_document_length}",
            )
        else:
            check(
                self.min_document_length <= self.sequence_length,
                "min_document_length",
                f"must be <= the longest document, max_document_length (None: the sequence length, "
                f"{self.sequence_length}), got {self.min_document_length}",
            )


@configclass
class BlendSourceConfig(Config):
    """One source of a `blended` dataset: a prepared dataset (`path`) or any dataset (`dataset`), and its weight."""

    weight: float = field(
        1.0,
        doc="Its share of the training samples: weight / the sum of the sources' weights (they need not sum to 1).",
        validator=greater_than(0),
    )
    path: str | None = field(
        None, doc="A dataset written by `blockzoo prepare` (its `--output` prefix); or give `dataset` instead."
    )
    validation_fraction: float = field(
        0.0, doc="With `path`: the fraction of its documents held out for evaluation.", validator=_check_fraction
    )
    dataset: DatasetConfig | None = field(
        None,
        doc="Any dataset (`type` and its fields), instead of `path`. Its sequence_length and micro_batch_size are the "
        "blend's; its seed, when not set, the blend's.",
    )

    def __attrs_post_init__(self) -> None:
        check(
            (self.path is None) != (self.dataset is None),
            "path",
            "give either `path` (a prepared dataset) or `dataset` (any dataset config), not "
            + ("both" if self.path is not None else "neither"),
        )
        check(
            self.path is not None or self.validation_fraction == 0,
            "validation_fraction",
            "applies to a `path` source; set it in `dataset` instead",
        )


@configclass
class BlendedDatasetConfig(DatasetConfig):
    """Several datasets mixed in fixed proportions. Training sample i goes to the source whose count lags its
    share × (i + 1) the most (ties: the first listed), so every prefix of the stream holds each source's share
    within one sample, and exactly after each whole period of the weights. A source's k-th sample is its own k-th
    training sample (its windows in its own shuffled epochs; a source read whole starts a new epoch). The evaluation
    split interleaves the held-out samples of the sources that have some, by the same rule among them, up to the
    first that runs out."""

    # Required: a blend of nothing has no default to build (`blockzoo plugins --check` builds only types that have).
    sources: dict[str, BlendSourceConfig] = field(
        doc="The sources by name (the names `source_tokens` in the metrics file uses)."
    )

    def __attrs_post_init__(self) -> None:
        check(bool(self.sources), "sources", "a blend needs at least one source: {name: {weight: ..., path: ...}}")
        check(len(self.sources) <= 255, "sources", f"at most 255 sources, got {len(self.sources)}")
