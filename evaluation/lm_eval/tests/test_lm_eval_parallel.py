"""Benchmarks under parallel layouts on gloo give the figures of one process: `blockzoo evaluate` under tensor
parallelism (every rank the same requests; with sequence-tensor parallelism, batches padded to the ranks), data
parallelism (each rank a share of the documents, gathered by lm-eval), pipeline parallelism (the forward passes
through the stages, alone and with two data ranks), and benchmarks during a data-parallel ZeRO 3 training run (the
sharded weights gathered once for the evaluation) and a pipeline-parallel one equal to `blockzoo evaluate` of that
step's checkpoint in one process."""

from __future__ import annotations

import json
import math

import pytest
from lm_eval_tasks import GENERATION_TASK, MC_TASK, PERPLEXITY_TASK
from test_lm_eval_training import run_config

from blockzoo.cli import main
from blockzoo.training.metrics import read_metrics
from blockzoo.training.trainer import Trainer
from blockzoo_lm_eval.benchmark import flat_metrics
from blockzoo_testing.distributed import run_distributed

ALL_TASKS = [MC_TASK, GENERATION_TASK, PERPLEXITY_TASK]
# layout -> (processes, tasks, overrides)
LAYOUTS = {
    "tensor-parallel": (2, ALL_TASKS, ["distributed.tensor_parallel=2"]),
    "sequence-tensor-parallel": (
        2,
        [MC_TASK, PERPLEXITY_TASK],
        ["distributed.tensor_parallel=2", "distributed.sequence_tensor_parallel=true"],
    ),
    "data-parallel": (2, ALL_TASKS, []),
    "pipeline-parallel": (2, ALL_TASKS, ["distributed.pipeline_parallel=2"]),
    "pipeline-and-data-parallel": (4, ALL_TASKS, ["distributed.pipeline_parallel=2"]),
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
    processes, tasks, overrides = LAYOUTS[layout]
    _, exported = transformer
    _evaluate(_arguments(exported, tasks, task_dir, tmp_path / "alone.json", 5))
    run_distributed(
        processes, _evaluate, [*_arguments(exported, tasks, task_dir, tmp_path / "ranks.json", 5), *overrides]
    )
    reference = flat_metrics(json.loads((tmp_path / "alone.json").read_text()))
    assert reference[f"harness/{MC_TASK}/sample_len"] == 5  # an odd count: one data rank has a document more
    assert_same_figures(flat_metrics(json.loads((tmp_path / "ranks.json").read_text())), reference)


def _train(output_dir: str, task_dir: str, layout: str) -> None:
    config = TRAINING_LAYOUTS[layout][1]
    with Trainer(run_config(output_dir, task_dir, **config), log=lambda _: None) as trainer:
        trainer.run()


# layout -> (processes, the run's model and layout)
TRAINING_LAYOUTS = {
    "data-parallel-zero-3": (2, {"zero_stage": 3}),
    "pipeline-parallel": (2, {"num_blocks": 2, "gradient_accumulation": 2, "pipeline_parallel": 2}),
}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", TRAINING_LAYOUTS)
def test_benchmarks_during_training_as_blockzoo_evaluate_finds_on_the_checkpoint(layout, task_dir, tmp_path):
    run_distributed(TRAINING_LAYOUTS[layout][0], _train, str(tmp_path / "run"), str(task_dir), layout)
    entries = {entry["step"]: entry for entry in read_metrics(tmp_path / "run" / "metrics.jsonl")}
    for step in (2, 3):
        logged = {name: value for name, value in entries[step].items() if name.startswith("harness/")}
        assert logged == flat_metrics(json.loads((tmp_path / "run" / "evaluation" / f"step_{step}.json").read_text()))
        output = tmp_path / f"step_{step}.json"
        _evaluate(_arguments(tmp_path / "run" / f"step_{step}", [MC_TASK, PERPLEXITY_TASK], task_dir, output, 4))
        assert_same_figures(logged, flat_metrics(json.loads(output.read_text())))
