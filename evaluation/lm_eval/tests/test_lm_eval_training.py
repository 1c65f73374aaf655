"""Benchmarks during training (`training.evaluation.harness`): at their interval and at the end, on the model being
trained, their figures in that step's line of metrics.jsonl and their whole results in
`<output_dir>/evaluation/step_<N>.json`; the figures are those `blockzoo evaluate` finds on the checkpoint saved at
that step, and training goes on as it would without them."""

from __future__ import annotations

import json
import math

from lm_eval_tasks import MC_TASK, PERPLEXITY_TASK

from blockzoo.cli import main
from blockzoo.config import structure
from blockzoo.run_config import RunConfig
from blockzoo.training.metrics import read_metrics
from blockzoo.training.trainer import Trainer
from blockzoo_lm_eval.benchmark import flat_metrics

MODEL = {
    "hidden_size": 32,
    "embeddings": {"vocab_size": 257},  # the byte tokenizer of the embedded corpus
    "decoder": {
        "num_blocks": 1,
        "block": {
            "mixer": {"type": "attention", "heads": 2, "head_size": 16},
            "mlp": {"type": "mlp", "intermediate_size": 64},
        },
    },
}


def run_config(
    output_dir, task_dir, harness: bool = True, num_blocks: int = 1, gradient_accumulation: int = 1, **distributed
) -> RunConfig:
    evaluation = {"harness": {"tasks": [MC_TASK, PERPLEXITY_TASK], "interval": 2, "limit": 4}} if harness else {}
    if harness:
        evaluation["harness"]["task_paths"] = [str(task_dir)]
    return structure(
        {
            "model": {**MODEL, "decoder": {**MODEL["decoder"], "num_blocks": num_blocks}},
            "data": {"type": "embedded", "sequence_length": 32, "micro_batch_size": 2},
            "distributed": distributed,
            "training": {
                "train_iters": 3,
                "gradient_accumulation": gradient_accumulation,
                "log_interval": 1,
                "checkpoint_interval": 2,
                "checkpoint_keep": 5,
                "output_dir": str(output_dir),
                "evaluation": evaluation,
            },
        },
        RunConfig,
    )


def test_benchmarks_land_in_the_metrics_file_and_the_run_directory(task_dir, tmp_path):
    with Trainer(run_config(tmp_path / "run", task_dir), log=lambda _: None) as trainer:
        history = trainer.run()
    entries = {entry["step"]: entry for entry in read_metrics(tmp_path / "run" / "metrics.jsonl")}
    assert sorted(entries) == [1, 2, 3]
    assert not any(name.startswith("harness/") for name in entries[1])
    for step in (2, 3):  # the interval, and the end
        report = json.loads((tmp_path / "run" / "evaluation" / f"step_{step}.json").read_text())
        figures = flat_metrics(report)
        assert figures[f"harness/{MC_TASK}/sample_len"] == 4
        assert {name: entries[step][name] for name in figures} == figures
        assert entries[step]["loss"] == history[step - 1].loss  # the training figures stay in the same line

        # The model in place is the checkpoint of that step.
        output = tmp_path / f"evaluate_{step}.json"
        arguments = ["--tasks", f"{MC_TASK},{PERPLEXITY_TASK}", "--include-path", str(task_dir), "--limit", "4"]
        assert main(["evaluate", str(tmp_path / "run" / f"step_{step}"), *arguments, "--output", str(output)]) == 0
        evaluated = flat_metrics(json.loads(output.read_text()))
        assert evaluated.keys() == figures.keys()
        for name, value in figures.items():
            assert math.isclose(evaluated[name], value, rel_tol=1e-5), name

    # Training itself did not change: the same losses as a run without benchmarks.
    with Trainer(run_config(tmp_path / "plain", task_dir, harness=False), log=lambda _: None) as trainer:
        plain = trainer.run()
    assert [record.loss for record in plain] == [record.loss for record in history]
