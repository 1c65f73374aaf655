"""A tracker in a child process (`separate_process: true`): the core's own `jsonl` tracker run there writes what it
writes on a thread; a failure in the child comes back as the child's own exception; a child that dies is a failure
that names it; and a run's trackers in child processes hold the figures a run with them on threads holds."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from blockzoo.training.metrics import METRICS_FILE, read_metrics
from blockzoo.training.tracker_process import ChildProcessTracker, TrackerProcessError, _error
from blockzoo.training.tracking import RunStatus, TrackerRun
from blockzoo.training.tracking_config import JsonlTrackerConfig
from blockzoo_testing.tracking import logged_figures, tiny_run_config, train_tiny


def _run(output_dir) -> TrackerRun:
    return TrackerRun(config={}, parameters={}, output_dir=output_dir, start_step=0, name="jsonl")


def test_the_jsonl_tracker_in_a_child_process_writes_the_metrics_file(tmp_path):
    tracker = ChildProcessTracker(JsonlTrackerConfig(separate_process=True))
    tracker.start(_run(tmp_path))
    child = tracker.process.pid
    assert child != os.getpid()
    entries = [{"step": step, "loss": 1.0 / step, "source_tokens": {"web": 10 * step}} for step in (1, 2, 3)]
    for entry in entries:
        tracker.log(entry["step"], entry)
    tracker.finish(RunStatus(state="finished", step=3))
    assert tracker.process.returncode == 0  # it ended after its finish
    assert read_metrics(tmp_path / METRICS_FILE) == entries


def test_a_failure_in_the_child_is_raised_as_the_childs_own_exception(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    tracker = ChildProcessTracker(JsonlTrackerConfig(separate_process=True))
    with pytest.raises(OSError, match="file") as raised:  # what making <file>/run raises in the child
        tracker.start(_run(tmp_path / "file" / "run"))
    assert not isinstance(raised.value, TrackerProcessError)
    assert tracker.process.returncode is not None  # the child ended, and the proxy waited for it


def test_an_error_of_a_library_s_own_type_comes_back_named_as_that_type():
    # The child sends the type's name and message only; a type that is not Python's own is not imported here.
    error = _error("CommError", "network is unreachable")
    assert isinstance(error, TrackerProcessError) and type(error).__name__ == "CommError"
    assert str(error) == "network is unreachable"
    assert type(_error("UnicodeDecodeError", "bad byte")).__name__ == "UnicodeDecodeError"  # wants 5 arguments


def test_a_child_that_dies_is_a_failure_naming_it(tmp_path):
    tracker = ChildProcessTracker(JsonlTrackerConfig(separate_process=True))
    tracker.start(_run(tmp_path))
    os.kill(tracker.process.pid, signal.SIGKILL)
    tracker.process.wait(10)
    with pytest.raises(TrackerProcessError, match=r"ended without an answer \(exit code -9\)"):
        for step in range(1, 100):  # the first writes may still fit in the pipe's buffer
            tracker.log(step, {"step": step, "loss": 1.0})
            time.sleep(0.01)


def test_a_run_with_its_tracker_in_a_child_process_logs_what_a_thread_logs(tmp_path):
    deterministic = ("tokens", "loss", "learning_rate", "gradient_norm")
    train_tiny(tiny_run_config(tmp_path / "thread", "training.train_iters=4"))
    separate = "training.trackers={jsonl: {type: jsonl, separate_process: true}}"
    messages = train_tiny(tiny_run_config(tmp_path / "child", separate, "training.train_iters=4"))
    assert not [message for message in messages if message.startswith("tracker ")]
    assert logged_figures(tmp_path / "child", deterministic) == logged_figures(tmp_path / "thread", deterministic)
    lines = (tmp_path / "child" / METRICS_FILE).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]
