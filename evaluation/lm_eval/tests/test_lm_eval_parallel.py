"""Benchmarks under parallel layouts on gloo give the figures of one process: `blockzoo evaluate` under tensor
parallelism (every rank the same requests; with sequence-tensor parallelism, batches padded to the ranks), data
parallelism (each rank a share of the documents, gathered by lm-eval), and benchmarks during a data-parallel ZeRO 3
training run (the sharded weights gathered once for the evaluation) equal to `blockzoo evaluate` of that step's
checkpoint in one process."""

from __future__ import annotations

import json
import math

import pytest
from lm_eval_tasks import GENERATION_TASK, MC_TASK, PERPLEXITY_TASK
from test_lm_eval_training import run_config

from blockzoo.cli import main
from blockzoo.testing.distributed import run_distributed
from blockzoo.training.metrics import read_metrics
from blockzoo.training.trainer import Trainer
from blockzoo_lm_eval.benchmark import flat_metrics

LAYOUTS = {
    "tensor-parallel": ([MC_TASK, GENERATION_TASK, PERPLEXITY_TASK], ["distributed.tensor_parallel=2"]),
    "sequence-tensor-parallel": (
        [MC_TASK, PERPLEXITY_TASK],
        ["distributed.tensor_parallel=2", "distributed.sequence_tensor_parallel=true"],
    ),
    "data-parallel": ([MC_TASK, GENERATION_TASK, PERPLEXITY_TASK], []),
}


def _evaluate(arguments: list[str]) -> None:
    assert main(["evaluate", *arguments]) == 0


def _arguments(checkpoint, tasks, task_dir, output, limit: int) -> list[str]:
    tasks = ",".join(tasks)
    return [
        str(checkpoint),
        "--tasks",
        tasks,
        "--include-path",
        str(task_dir),
        "--output",
        str(output),
        f"--limit={limit}",
    ]


def assert_same_figures(ours: dict[str, float], reference: dict[str, float]) -> None:
    assert ours.keys() == reference.keys()
    for name, value in reference.items():
        assert math.isclose(ours[name], value, rel_tol=1e-5), (name, ours[name], value)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_evaluate_under_a_layout_as_in_one_process(layout, transformer, task_dir, tmp_path):
    tasks, overrides = LAYOUTS[layout]
    _, exported = transformer
    _evaluate(_arguments(exported, tasks, task_dir, tmp_path / "alone.json", 5))
    run_distributed(2, _evaluate, [*_arguments(exported, tasks, task_dir, tmp_path / "ranks.json", 5), *overrides])
    reference = flat_metrics(json.loads((tmp_path / "alone.json").read_text()))
    assert reference[f"harness/{MC_TASK}/sample_len"] == 5  # an odd count: one data rank has a document more
    assert_same_figures(flat_metrics(json.loads((tmp_path / "ranks.json").read_text())), reference)


def _train(output_dir: str, task_dir: str) -> None:
    with Trainer(run_config(output_dir, task_dir, zero_stage=3), log=lambda _: None) as trainer:
        trainer.run()


@pytest.mark.distributed
def test_benchmarks_during_data_parallel_zero_3_training(task_dir, tmp_path):
    run_distributed(2, _train, str(tmp_path / "run"), str(task_dir))
    entries = {entry["step"]: entry for entry in read_metrics(tmp_path / "run" / "metrics.jsonl")}
    for step in (2, 3):
        logged = {name: value for name, value in entries[step].items() if name.startswith("harness/")}
        assert logged == flat_metrics(json.loads((tmp_path / "run" / "evaluation" / f"step_{step}.json").read_text()))
        output = tmp_path / f"step_{step}.json"
        _evaluate(_arguments(tmp_path / "run" / f"step_{step}", [MC_TASK, PERPLEXITY_TASK], task_dir, output, 4))
        assert_same_figures(logged, flat_metrics(json.loads(output.read_text())))
