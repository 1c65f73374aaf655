"""The MLflow tracker against MLflow's own client reading the run's store: every figure of metrics.jsonl at its step,
the config as parameters, the end as the run's status; a resumed run continuing the same MLflow run with each step
once, or superseding it when the killed process had sent steps past its checkpoint (the reader then sees the resumed
run's figures of those steps, once); a failure that does not stop the run."""

import json
from pathlib import Path

from mlflow import MlflowClient

from blockzoo_testing.tracking import (
    DETERMINISTIC,
    logged_figures,
    straight_and_resumed,
    tiny_run_config,
    train_killed_at,
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
    # Killed right after its checkpoint of step 4: it sent nothing past it, so the resumed run continues its run.
    straight, resumed = straight_and_resumed(tmp_path, TRACKER, killed_at=4)
    read = read_metrics(resumed)
    assert sorted(read) == list(range(1, 9))
    deterministic = {step: {n: v for n, v in figures.items() if n in DETERMINISTIC} for step, figures in read.items()}
    assert deterministic == logged_figures(straight, DETERMINISTIC)
    run = only_run(resumed)
    assert run.info.status == "FINISHED" and run.data.tags["blockzoo.resumed_at_step"] == "4"
    assert "blockzoo.supersedes" not in run.data.tags


def test_a_resumed_run_supersedes_the_steps_a_killed_process_sent_past_its_checkpoint(tmp_path):
    straight, output_dir = tmp_path / "straight", tmp_path / "resumed"
    train_tiny(tiny_run_config(straight, TRACKER))
    train_killed_at(tiny_run_config(output_dir, TRACKER), 6)  # sent steps 5 and 6, past its checkpoint of step 4
    killed_id = only_run(output_dir).info.run_id
    killed = read_metrics(output_dir)
    assert sorted(killed) == list(range(1, 7))
    # Resumed with another learning rate: steps 5 and 6 get other figures than the killed process sent.
    train_tiny(tiny_run_config(output_dir, TRACKER, "training.optimizer.learning_rate=0.02"))
    read = read_metrics(output_dir)  # the experiment's only (active) run, the one the record names
    assert sorted(read) == list(range(1, 9))
    deterministic = {step: {n: v for n, v in figures.items() if n in DETERMINISTIC} for step, figures in read.items()}
    assert deterministic == logged_figures(output_dir, DETERMINISTIC)  # the resumed run's metrics.jsonl
    for step in (5, 6):
        assert read[step]["learning_rate"] != killed[step]["learning_rate"]
    assert read[6]["loss"] != killed[6]["loss"]  # step 5's loss is that of the checkpoint's weights, as before
    for step in range(1, 5):  # replayed from the killed run: the same points
        assert read[step] == killed[step]
    client, run = client_of(output_dir), only_run(output_dir)
    assert run.info.run_id != killed_id and run.info.status == "FINISHED"
    assert run.data.tags["blockzoo.supersedes"] == killed_id and run.data.tags["blockzoo.resumed_at_step"] == "4"
    assert run.data.params["model.hidden_size"] == "16"
    old = client.get_run(killed_id)
    assert old.info.lifecycle_stage == "deleted" and old.info.status == "KILLED"
    assert old.data.tags["blockzoo.superseded_by"] == run.info.run_id
    record = json.loads((output_dir / "trackers" / "ml.json").read_text())
    assert record["superseded"] == [killed_id] and record["last_step"] == 8


def test_a_store_that_cannot_be_opened_is_reported_once_and_the_run_trains_on(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    tracker = f"training.trackers={{ml: {{type: mlflow, tracking_uri: 'sqlite:///{tmp_path}/file/x/mlflow.db'}}}}"
    messages = train_tiny(tiny_run_config(tmp_path / "run", tracker, "training.train_iters=3"))
    failures = [message for message in messages if "tracker 'ml' failed" in message]
    assert len(failures) == 1, messages
    assert sorted(logged_figures(tmp_path / "run")) == [1, 2, 3]
