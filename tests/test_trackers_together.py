"""The three tracker distributions with the core's jsonl in one run: only rank 0 of a data-parallel gloo run writes
(one set of tracker files, each step once), and `blockzoo train` on the command line feeds them all."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from blockzoo.config import to_dict
from blockzoo_testing.distributed import run_distributed
from blockzoo_testing.tracking import logged_figures, tiny_run_config, train_tiny

ALL = (
    "training.trackers={tb: {type: tensorboard}, wb: {type: wandb, mode: offline}, "
    "ml: {type: mlflow, experiment: tiny}}"
)


def _train_every_rank(root: str, trackers: str) -> None:
    train_tiny(tiny_run_config(root, trackers, "training.train_iters=3"))


def check_one_set_of_files(root: Path, steps: list[int]) -> None:
    assert sorted(logged_figures(root)) == steps
    assert len((root / "metrics.jsonl").read_text().splitlines()) == len(steps)
    assert len(list((root / "tensorboard").glob("events.out.tfevents.*"))) == 1
    assert len(list((root / "wandb").glob("offline-run-*"))) == 1
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert [point.step for point in client.get_metric_history(run.info.run_id, "loss")] == steps
    assert sorted(path.name for path in (root / "trackers").iterdir()) == ["ml.json", "wb.json"]


@pytest.mark.distributed
def test_only_rank_0_writes_a_tracker_of_a_data_parallel_run(tmp_path):
    run_distributed(2, _train_every_rank, str(tmp_path), "training.trackers={tb: {type: tensorboard}}")
    assert sorted(logged_figures(tmp_path)) == [1, 2, 3]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 1


@pytest.mark.slow  # about a minute on a shared CPU: mlflow and wandb start in both ranks' imports
@pytest.mark.distributed
def test_only_rank_0_writes_the_trackers_of_a_data_parallel_run(tmp_path):
    run_distributed(2, _train_every_rank, str(tmp_path), ALL)
    check_one_set_of_files(tmp_path, [1, 2, 3])


@pytest.mark.slow  # half a minute: a fresh process imports mlflow and wandb
def test_blockzoo_train_feeds_every_tracker(tmp_path):
    config = tiny_run_config(tmp_path / "run", ALL, "training.train_iters=2")
    (tmp_path / "run.yaml").write_text(json.dumps(to_dict(config)))  # JSON is YAML
    result = subprocess.run(
        [sys.executable, "-m", "blockzoo", "train", str(tmp_path / "run.yaml")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "trackers: jsonl (jsonl), tb (tensorboard), wb (wandb), ml (mlflow)" in lines
    assert not [line for line in lines if line.startswith("tracker '")]  # no failure to report
    check_one_set_of_files(tmp_path / "run", [1, 2])
