"""The `benchmark` kind: its config base and the interface of a backend. Torch-free.

A backend plugin registers a config class deriving from `BenchmarkConfig` (through `register_components`) and an
implementation class deriving from `Benchmark`; the core builds it from its config and calls `evaluate` with the
model in evaluation mode (no gradients), on every rank of the run's layout. The first-party backend is
`lm_eval` (lm-evaluation-harness, distribution `blockzoo-lm-eval`), the default type.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import attrs

from blockzoo.config import PolymorphicConfig, at_least, configclass, field


@configclass
class BenchmarkConfig(PolymorphicConfig):
    """Scoring a model on benchmark tasks, in memory: `blockzoo evaluate`, and `training.evaluation.harness` during
    training. Kind `benchmark`, default type `lm_eval` (lm-evaluation-harness, from blockzoo-lm-eval)."""

    kind: ClassVar[str] = "benchmark"
    default_type: ClassVar[str] = "lm_eval"

    interval: int | None = field(
        None,
        doc="During training: run every this many steps, and at the end; None: at the end only.",
        validator=at_least(1),
    )


@attrs.frozen
class BenchmarkResult:
    """What a backend returns. `metrics`: flat names (`harness/<task>/<metric>`) to numbers, logged with the step
    (metrics.jsonl, trackers); `report`: the backend's whole results (JSON-able), written as they are. The same on
    every rank."""

    metrics: dict[str, float]
    report: dict[str, Any]


class Benchmark:
    """A backend, built from its config (`Benchmark(config)`: refuses what it cannot run, such as unknown tasks,
    before a training run starts)."""

    def __init__(self, config: BenchmarkConfig):
        self.config = config

    def evaluate(
        self, model: Any, tokenizer: Any, distributed: Any, *, stop_tokens: Sequence[int] = ()
    ) -> BenchmarkResult:
        """Score `model` (a `LanguageModel`, this rank's part of it), whose text `tokenizer` (a
        `blockzoo.api.Tokenizer`) encodes, on every rank of `distributed`'s layout. `stop_tokens`: the ids that end
        a generation (the first is the end-of-text token); empty: the tokenizer's `eod_token_id`."""
        raise NotImplementedError
