"""The TensorBoard tracker against TensorBoard's own reader (EventAccumulator): every figure of the run's
metrics.jsonl at its step, a resumed run's steps superseding those a killed process had logged, a failure that does
not stop the run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from blockzoo.config import to_dict
from blockzoo_testing.tracking import (
    DETERMINISTIC,
    logged_figures,
    straight_and_resumed,
    tiny_run_config,
    train_tiny,
)

TRACKER = "training.trackers={tb: {type: tensorboard}}"


def read_scalars(log_dir: Path) -> dict[int, dict[str, float]]:
    """Every scalar of `log_dir` by step, as TensorBoard shows it (purged steps left out)."""
    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    steps: dict[int, dict[str, float]] = {}
    for tag in accumulator.Tags()["scalars"]:
        for event in accumulator.Scalars(tag):
            assert tag not in steps.get(event.step, {}), f"{tag} twice at step {event.step}"
            steps.setdefault(event.step, {})[tag] = event.value
    return steps


def assert_figures_equal(read: dict[int, dict[str, float]], expected: dict[int, dict[str, float]]) -> None:
    assert sorted(read) == sorted(expected)
    for step, figures in expected.items():
        assert sorted(read[step]) == sorted(figures), step
        for name, value in figures.items():  # event files hold float32
            assert read[step][name] == pytest.approx(value, rel=1e-6, abs=1e-30), (step, name)


def test_every_figure_of_the_metrics_file_at_its_step(tmp_path):
    config = tiny_run_config(
        tmp_path, TRACKER, "data.validation_fraction=0.25", "training.evaluation.interval=4", "training.log_interval=2"
    )
    train_tiny(config)
    expected = logged_figures(tmp_path)
    assert sorted(expected) == [2, 4, 6, 8] and "evaluation_loss" in expected[4] and "tflops" in expected[2]
    assert_figures_equal(read_scalars(tmp_path / "tensorboard"), expected)


def test_the_run_config_and_status_as_text(tmp_path):
    train_tiny(tiny_run_config(tmp_path, TRACKER, "training.train_iters=2"))
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    accumulator.Reload()
    texts = {
        tag: accumulator.Tensors(tag)[-1].tensor_proto.string_val[0].decode() for tag in accumulator.Tags()["tensors"]
    }
    assert "hidden_size: 16" in texts["run/config/text_summary"]
    assert '"total"' in texts["run/parameters/text_summary"]
    assert texts["run/status/text_summary"] == "finished at step 2"


def test_a_resumed_run_supersedes_the_steps_past_its_checkpoint(tmp_path):
    straight, resumed = straight_and_resumed(tmp_path, TRACKER, killed_at=6)
    assert len(list((resumed / "tensorboard").glob("events.out.tfevents.*"))) == 2  # the killed process's, and ours
    read = read_scalars(resumed / "tensorboard")
    assert sorted(read) == list(range(1, 9))
    # steps 5 and 6 are the resumed run's (the killed process's were purged): they equal the straight run's, as does
    # the whole metrics file of the resumed run
    assert_figures_equal(read, logged_figures(resumed))
    deterministic = {step: {n: v for n, v in figures.items() if n in DETERMINISTIC} for step, figures in read.items()}
    assert_figures_equal(deterministic, logged_figures(straight, DETERMINISTIC))


def test_a_log_dir_that_cannot_be_made_is_reported_once_and_the_run_trains_on(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    tracker = f"training.trackers={{tb: {{type: tensorboard, log_dir: {tmp_path / 'file' / 'tb'}}}}}"
    messages = train_tiny(tiny_run_config(tmp_path / "run", tracker, "training.train_iters=3"))
    failures = [message for message in messages if "tracker 'tb' failed" in message]
    assert len(failures) == 1 and "Error" in failures[0], messages
    assert sorted(logged_figures(tmp_path / "run")) == [1, 2, 3]  # jsonl, the other tracker, got every step


def test_with_trackers_required_blockzoo_train_stops_with_one_line_naming_the_tracker(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    config = tiny_run_config(tmp_path / "run", "training.train_iters=2")
    (tmp_path / "run.yaml").write_text(json.dumps(to_dict(config)))  # JSON is YAML
    tracker = f"training.trackers={{tb: {{type: tensorboard, log_dir: {tmp_path / 'file' / 'tb'}}}}}"
    command = ["train", str(tmp_path / "run.yaml"), tracker, "training.trackers_required=true"]
    result = subprocess.run([sys.executable, "-m", "blockzoo", *command], capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.startswith("blockzoo: error: tracker 'tb' failed: ") and "Traceback" not in result.stderr
    assert result.stderr.rstrip().endswith("(training.trackers_required is set)")
    assert not (tmp_path / "run" / "step_1").exists()  # stopped before the first step
