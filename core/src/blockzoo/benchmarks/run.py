"""Running a benchmark backend on a model: during training (`HarnessRunner`, `training.evaluation.harness`) and from
a checkpoint (`blockzoo evaluate`). The model runs in evaluation mode without gradients, on every rank of the
layout: tensor-parallel ranks run the same requests, data-parallel ranks share them (the backend's business),
ZeRO / FSDP weights are gathered once for the whole evaluation (`gathered_for_inference`). Under pipeline parallelism
the backend gets a `PipelinedModel`, whose forward passes run through the stages (every pipeline rank the same
requests, the last stage's logits broadcast to them)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from blockzoo.benchmarks.base import Benchmark, BenchmarkConfig, BenchmarkResult
from blockzoo.distributed.data_parallel import gathered_for_inference
from blockzoo.distributed.pipeline_inference import PipelinedModel, gathered_stages
from blockzoo.distributed.runtime import Distributed
from blockzoo.plugins import get_registry

EVALUATION_DIRECTORY = "evaluation"


def build_benchmark(config: BenchmarkConfig) -> Benchmark:
    """The backend of `config`'s type, built (it refuses what it cannot run: unknown tasks, a missing library)."""
    return get_registry().implementation_of(config)(config)


@torch.no_grad()
def evaluate_model(
    benchmark: Benchmark, model: Any, tokenizer: Any, distributed: Distributed, *, stop_tokens: Sequence[int] = ()
) -> BenchmarkResult:
    """`benchmark` on `model` (every rank calls it), in evaluation mode, then back to the mode it was in; the result
    as rank 0 has it, on every rank."""
    training = model.training
    model.eval()
    pipeline = getattr(model, "pipeline", None)  # a pipelined model runs through its stages
    try:
        if pipeline is None:
            with gathered_for_inference(model, distributed):
                result = benchmark.evaluate(model, tokenizer, distributed, stop_tokens=stop_tokens)
        else:
            with gathered_stages(pipeline):
                result = benchmark.evaluate(PipelinedModel(pipeline), tokenizer, distributed, stop_tokens=stop_tokens)
    finally:
        model.train(training)
    if distributed.world_size > 1:  # one result for every rank, rank 0's
        shared = [result if distributed.rank == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        result = shared[0]
    return result


def write_report(path: str | Path, result: BenchmarkResult) -> Path:
    """The backend's results as JSON at `path`, written whole or not at all (a temporary file renamed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(result.report, indent=2, default=str) + "\n")
    os.replace(partial, path)
    return path


def results_table(metrics: dict[str, float]) -> str:
    """The flat metrics as an aligned two-column table."""
    if not metrics:
        return "(no metrics)"
    width = max(len(name) for name in metrics)
    return "\n".join(f"{name:<{width}}  {_number(value)}" for name, value in metrics.items())


def _number(value: float) -> str:
    return "nan" if math.isnan(value) else f"{value:.4f}" if abs(value) < 1e6 else f"{value:.4g}"


class HarnessRunner:
    """The benchmark of a training run (`training.evaluation.harness`): built when the trainer starts, so that an
    unknown task, a missing plugin or library stops the run before its first step."""

    def __init__(
        self, config: BenchmarkConfig, tokenizer: Any, distributed: Distributed, *, stop_tokens: Sequence[int] = ()
    ):
        self.config = config
        self.tokenizer = tokenizer
        self.stop_tokens = list(stop_tokens)
        self.distributed = distributed
        self.benchmark = build_benchmark(config)

    def due(self, step: int, last: bool) -> bool:
        interval = self.config.interval
        return last or (interval is not None and step % interval == 0)

    def run(self, model: Any, *, step: int, output_dir: Path, log: Callable[[str], None]) -> dict[str, float]:
        """The benchmark on the model being trained: its figures (for the step's logged entry), its whole results
        written (rank 0) to `<output_dir>/evaluation/step_<step>.json`, one line logged."""
        result = evaluate_model(self.benchmark, model, self.tokenizer, self.distributed, stop_tokens=self.stop_tokens)
        if self.distributed.rank == 0:
            path = write_report(output_dir / EVALUATION_DIRECTORY / f"step_{step}.json", result)
            figures = ", ".join(f"{name} {_number(value)}" for name, value in result.metrics.items())
            log(f"benchmark at step {step}: {figures or 'no metrics'} ({path})")
        return dict(result.metrics)
