"""The W&B tracker against the offline run files wandb writes (read with wandb's own protobuf records, as `wandb
sync` uploads them): every figure of metrics.jsonl at its step, the config, the end; a resumed run continuing the
same W&B run with each step once over its processes' files, or superseding it with a new run when the killed process
had sent steps past its checkpoint; a failure that does not stop the run. Never online."""

import json
import os
import sys
import time
from pathlib import Path

from wandb_files import history, run_files, run_info

from blockzoo_testing.tracking import (
    DETERMINISTIC,
    logged_figures,
    tiny_run_config,
    train_killed_at,
    train_tiny,
)
from blockzoo_wandb.plugin import check_environment

TRACKER = "training.trackers={wb: {type: wandb, mode: offline, project: tiny, tags: [a, b]}}"


def files_of(output_dir: Path) -> list[Path]:
    run_id = json.loads((output_dir / "trackers" / "wb.json").read_text())["run_id"]
    return run_files(output_dir / "wandb", run_id)


def by_step(rows: list[dict]) -> dict[int, dict[str, float]]:
    steps: dict[int, dict[str, float]] = {}
    for row in rows:
        step = row.pop("_step")
        assert step not in steps, f"step {step} twice in the run's history"
        steps[step] = row
    return steps


def test_every_figure_of_the_metrics_file_the_config_and_the_status(tmp_path):
    overrides = ["data.validation_fraction=0.25", "training.evaluation.interval=4", "training.log_interval=2"]
    train_tiny(tiny_run_config(tmp_path, TRACKER, *overrides))
    (path,) = files_of(tmp_path)
    expected = logged_figures(tmp_path)
    assert sorted(expected) == [2, 4, 6, 8] and "evaluation_loss" in expected[4]
    assert by_step(history([path])) == expected
    info = run_info(path)
    assert info["project"] == "tiny" and info["exit_code"] == 0 and info["summary"]["status"] == "finished"
    assert info["config"]["model"]["hidden_size"] == 16 and info["config"]["parameters"]["total"]["parameters"] > 0


def test_a_resumed_run_continues_the_wandb_run_each_step_once(tmp_path):
    # Killed right after its checkpoint of step 4: it sent nothing past it, so the resumed run continues its run.
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train_tiny(tiny_run_config(straight, TRACKER))
    train_killed_at(tiny_run_config(resumed, TRACKER), 4)
    time.sleep(1.1)  # wandb names a process's offline folder by the second it started: two in one second share one
    train_tiny(tiny_run_config(resumed, TRACKER))
    killed, again = files_of(resumed)  # one file per process, one run id
    assert run_info(killed)["run_id"] == run_info(again)["run_id"]
    assert run_info(killed)["exit_code"] == 1 and "Killed" in run_info(killed)["summary"]["status_message"]
    read = by_step(history([killed, again]))
    assert sorted(read) == list(range(1, 9))
    assert sorted(by_step(history([again]))) == [5, 6, 7, 8]
    deterministic = {step: {n: v for n, v in figures.items() if n in DETERMINISTIC} for step, figures in read.items()}
    assert deterministic == logged_figures(straight, DETERMINISTIC)


def test_a_resumed_run_supersedes_the_steps_a_killed_process_sent_past_its_checkpoint(tmp_path):
    output_dir = tmp_path / "run"
    train_killed_at(tiny_run_config(output_dir, TRACKER), 6)  # sent steps 5 and 6, past its checkpoint of step 4
    (killed,) = files_of(output_dir)
    killed_id, killed_steps = run_info(killed)["run_id"], by_step(history([killed]))
    assert sorted(killed_steps) == list(range(1, 7))
    time.sleep(1.1)
    # Resumed with another learning rate: steps 5 and 6 get other figures than the killed process sent.
    train_tiny(tiny_run_config(output_dir, TRACKER, "training.optimizer.learning_rate=0.02"))
    (path,) = files_of(output_dir)  # the run the record names now: a new one, written by the resumed process alone
    info = run_info(path)
    assert info["run_id"] != killed_id and info["exit_code"] == 0 and info["summary"]["status"] == "finished"
    assert f"Supersedes W&B run {killed_id}" in info["notes"]
    read = by_step(history([path]))
    assert sorted(read) == list(range(1, 9))
    deterministic = {step: {n: v for n, v in figures.items() if n in DETERMINISTIC} for step, figures in read.items()}
    assert deterministic == logged_figures(output_dir, DETERMINISTIC)  # the resumed run's metrics.jsonl
    for step in (5, 6):
        assert read[step]["learning_rate"] != killed_steps[step]["learning_rate"]
    assert read[6]["loss"] != killed_steps[6]["loss"]  # step 5's loss is that of the checkpoint's weights, as before
    for step in range(1, 5):  # replayed from metrics.jsonl: what the killed process had sent
        assert read[step] == killed_steps[step]
    record = json.loads((output_dir / "trackers" / "wb.json").read_text())
    assert record["superseded"] == [killed_id] and record["last_step"] == 8


def test_a_dir_that_cannot_be_made_is_reported_once_and_the_run_trains_on(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    tracker = f"training.trackers={{wb: {{type: wandb, mode: offline, dir: {tmp_path / 'file' / 'wb'}}}}}"
    messages = train_tiny(tiny_run_config(tmp_path / "run", tracker, "training.train_iters=3"))
    failures = [message for message in messages if "tracker 'wb' failed" in message]
    assert len(failures) == 1, messages
    assert sorted(logged_figures(tmp_path / "run")) == [1, 2, 3]


def test_wandb_missing_is_a_tracker_failure_that_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError, as where it is not installed
    tracker = "training.trackers={wb: {type: wandb, mode: offline, separate_process: false}}"  # in this process
    messages = train_tiny(tiny_run_config(tmp_path, tracker, "training.train_iters=2"))
    assert [message for message in messages if message.startswith("tracker ")] == [
        "tracker 'wb' failed: ImportError: the wandb tracker needs wandb: pip install wandb (import of wandb halted; "
        "None in sys.modules); the run trains on without it (training.trackers_required: true stops it instead)"
    ]
    assert sorted(logged_figures(tmp_path)) == [1, 2]
    assert check_environment() == ["wandb is not installed: pip install wandb (runs train without this tracker)"]


def test_wandb_missing_in_the_trackers_process_is_reported_the_same_way(tmp_path, monkeypatch):
    # The tracker's child process imports wandb itself: a `wandb` package on its path that fails to import stands in
    # for a missing one there.
    shadow = tmp_path / "shadow" / "wandb"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'wandb'\")\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(shadow.parent), os.environ.get("PYTHONPATH", "")]))
    messages = train_tiny(tiny_run_config(tmp_path / "run", TRACKER, "training.train_iters=2"))
    assert [message for message in messages if message.startswith("tracker ")] == [
        "tracker 'wb' failed: ImportError: the wandb tracker needs wandb: pip install wandb (No module named "
        "'wandb'); the run trains on without it (training.trackers_required: true stops it instead)"
    ]
    assert sorted(logged_figures(tmp_path / "run")) == [1, 2]
