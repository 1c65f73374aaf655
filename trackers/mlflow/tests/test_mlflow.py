"""The MLflow tracker against MLflow's own client reading the run's store: every figure of metrics.jsonl at its step,
the config as parameters, the end as the run's status; a resumed run continuing the same MLflow run with each step
once; a failure that does not stop the run."""

import json
from pathlib import Path

from mlflow import MlflowClient

from blockzoo.testing.tracking import (
    DETERMINISTIC,
    logged_figures,
    straight_and_resumed,
    tiny_run_config,
    train_tiny,
)

TRACKER = "training.trackers={ml: {type: mlflow, experiment: tiny}}"


def client_of(output_dir: Path) -> MlflowClient:
    return MlflowClient(tracking_uri=f"sqlite:///{output_dir / 'mlflow.db'}")


def only_run(output_dir: Path):
    client = client_of(output_dir)
    runs = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert len(runs) == 1
    assert json.loads((output_dir / "trackers" / "ml.json").read_text())["run_id"] == runs[0].info.run_id
    return runs[0]


def read_metrics(output_dir: Path) -> dict[int, dict[str, float]]:
    """Every metric point of the run by step; a step twice in one metric's history fails."""
    client, run = client_of(output_dir), only_run(output_dir)
    steps: dict[int, dict[str, float]] = {}
    for key in run.data.metrics:
        for point in client.get_metric_history(run.info.run_id, key):
            assert key not in steps.get(point.step, {}), f"{key} twice at step {point.step}"
            steps.setdefault(point.step, {})[key] = point.value
    return steps


def test_every_figure_of_the_metrics_file_the_config_and_the_status(tmp_path):
    overrides = ["data.validation_fraction=0.25", "training.evaluation.interval=4", "training.log_interval=2"]
    train_tiny(tiny_run_config(tmp_path, TRACKER, *overrides))
    expected = logged_figures(tmp_path)
    assert sorted(expected) == [2, 4, 6, 8] and "evaluation_loss" in expected[4]
    assert read_metrics(tmp_path) == expected
    run = only_run(tmp_path)
    assert run.info.status == "FINISHED" and run.info.run_name == tmp_path.name
    assert run.data.params["model.hidden_size"] == "16" and run.data.params["training.train_iters"] == "8"
    assert int(run.data.params["parameters/total"]) > 257 * 16


def test_a_resumed_run_continues_the_mlflow_run_each_step_once(tmp_path):
    straight, resumed = straight_and_resumed(tmp_path, TRACKER, killed_at=6)
    read = read_metrics(resumed)
    assert sorted(read) == list(range(1, 9))
    deterministic = {step: {n: v for n, v in figures.items() if n in DETERMINISTIC} for step, figures in read.items()}
    assert deterministic == logged_figures(straight, DETERMINISTIC)
    run = only_run(resumed)
    assert run.info.status == "FINISHED" and run.data.tags["blockzoo.resumed_at_step"] == "4"


def test_a_store_that_cannot_be_opened_is_reported_once_and_the_run_trains_on(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    tracker = f"training.trackers={{ml: {{type: mlflow, tracking_uri: 'sqlite:///{tmp_path}/file/x/mlflow.db'}}}}"
    messages = train_tiny(tiny_run_config(tmp_path / "run", tracker, "training.train_iters=3"))
    failures = [message for message in messages if "tracker 'ml' failed" in message]
    assert len(failures) == 1, messages
    assert sorted(logged_figures(tmp_path / "run")) == [1, 2, 3]
