"""Trackers (`training.trackers`): the kind's config (jsonl on by default, merged, `null` removes one), what a tracker
receives (the run's start, every entry of metrics.jsonl, how the run ended), and failure isolation: a tracker that
raises, hangs or falls behind is reported once and neither stops nor slows the run, unless `trackers_required`."""

from __future__ import annotations

import os
import signal
import threading
import time
import types

import pytest

from blockzoo.api import RunStatus, Tracker, TrackerConfig, configclass, field, hookimpl
from blockzoo.checkpoint import latest_checkpoint
from blockzoo.config import ConfigError
from blockzoo.plugins import register_plugin
from blockzoo.training import tracking
from blockzoo.training.metrics import METRICS_FILE, read_metrics
from blockzoo.training.tracking_config import JsonlTrackerConfig, active_trackers
from blockzoo.training.trainer import Trainer, TrainingError
from blockzoo_testing.tracking import logged_figures, tiny_run_config, train_killed_at, train_tiny


@configclass
class ProbeTrackerConfig(TrackerConfig):
    """A tracker of this test: records every call, and fails, hangs or sleeps where told."""

    fail_in: str | None = field(None, doc="start, log or finish: raise there.")
    block_in_log: bool = field(False, doc="Wait in each log until the test releases it.")
    hang_in_finish: bool = field(False, doc="Never return from finish.")


CALLS: dict[str, list] = {}  # tracker name -> its calls, in order
RELEASE = threading.Event()  # what a hanging tracker waits for


class ProbeTracker(Tracker):
    def start(self, run):
        self.name = run.name
        CALLS[self.name] = [("start", run)]
        self._maybe_fail("start")

    def log(self, step, entry):
        CALLS[self.name].append(("log", step, dict(entry)))
        if self.config.block_in_log:
            RELEASE.wait()
        self._maybe_fail("log")

    def finish(self, status):
        CALLS[self.name].append(("finish", status))
        if self.config.hang_in_finish:
            RELEASE.wait()
        self._maybe_fail("finish")

    def _maybe_fail(self, where):
        if self.config.fail_in == where:
            raise OSError(f"no space left on device (in {where})")


@configclass
class BrokenTrackerConfig(TrackerConfig):
    """A tracker type whose implementation does not exist."""


def plugin_registering(name: str, config_class: type, implementation: str) -> types.SimpleNamespace:
    """An in-process plugin registering `config_class` as tracker type `name`, built by `implementation`."""

    @hookimpl
    def register_components(register):
        register(name, config_class, f"{__name__}:{implementation}")

    return types.SimpleNamespace(register_components=register_components)


@pytest.fixture(autouse=True)
def probe(blockzoo_registry):
    CALLS.clear()
    RELEASE.clear()
    register_plugin(plugin_registering("probe.tracker", ProbeTrackerConfig, "ProbeTracker"), "probe")
    yield
    RELEASE.set()


def probes(*specs: str) -> str:
    return "training.trackers={" + ", ".join(f"{name}: {{type: probe.tracker{extra}}}" for name, extra in specs) + "}"


def calls(name: str, kind: str) -> list:
    return [call for call in CALLS.get(name, []) if call[0] == kind]  # none before its thread has started it


# ---------------------------------------------------------------------------------------------------------------------
# The config


def test_jsonl_is_on_by_default_kept_when_others_are_added_and_removed_by_null(tmp_path):
    assert active_trackers(tiny_run_config(tmp_path).training.trackers) == {"jsonl": JsonlTrackerConfig()}
    added = tiny_run_config(tmp_path, probes(("p", ""))).training.trackers
    assert list(active_trackers(added)) == ["jsonl", "p"]
    removed = tiny_run_config(tmp_path, "training.trackers={jsonl: null, p: {type: probe.tracker}}")
    assert list(active_trackers(removed.training.trackers)) == ["p"]


def test_an_unknown_tracker_type_names_the_field_and_what_is_available(tmp_path):
    with pytest.raises(ConfigError) as error:
        tiny_run_config(tmp_path, "training.trackers={tb: {type: tensorbord}}")
    message = str(error.value)
    assert "training.trackers.tb.type: unknown tracker type 'tensorbord'" in message and "jsonl" in message


def test_a_first_party_tracker_not_loaded_says_which_distribution(tmp_path, core_only_registry):
    with pytest.raises(ConfigError) as error:
        tiny_run_config(tmp_path, "training.trackers={wb: {type: wandb}}")
    assert "training.trackers.wb.type: unknown tracker type 'wandb' (available: jsonl)" in str(error.value)
    assert "blockzoo-wandb" in str(error.value)


# ---------------------------------------------------------------------------------------------------------------------
# What a tracker receives


def test_a_tracker_gets_the_start_every_entry_of_the_metrics_file_and_the_end(tmp_path):
    messages = train_tiny(tiny_run_config(tmp_path, probes(("p", "")), "training.train_iters=3"))
    assert "trackers: jsonl (jsonl), p (probe.tracker)" in messages
    assert not [message for message in train_tiny(tiny_run_config(tmp_path / "b")) if message.startswith("trackers")]
    ((_, run),) = calls("p", "start")
    assert run.name == "p" and run.output_dir == tmp_path and run.start_step == 0
    assert (
        run.config["model"]["hidden_size"] == 16 and run.config["training"]["trackers"]["p"]["type"] == "probe.tracker"
    )
    assert run.parameters["embeddings"]["parameters"] == 257 * 16 and run.parameters["total"]["parameters"] >= 257 * 16
    entries = read_metrics(tmp_path / METRICS_FILE)
    assert [(step, entry) for _, step, entry in calls("p", "log")] == [(entry["step"], entry) for entry in entries]
    assert CALLS["p"][-1] == ("finish", RunStatus(state="finished", step=3))


def test_a_resumed_run_starts_its_trackers_at_its_checkpoint(tmp_path):
    config = tiny_run_config(tmp_path, probes(("p", "")))
    train_killed_at(config, 6)
    ((_, status),) = calls("p", "finish")
    assert status.state == "failed" and status.step == 7 and "Killed: killed after step 6" in status.message
    train_tiny(config)
    assert calls("p", "start")[0][1].start_step == 4
    assert [step for _, step, _ in calls("p", "log")] == [5, 6, 7, 8]
    assert sorted(logged_figures(tmp_path)) == list(range(1, 9))  # jsonl dropped the killed run's 5 and 6


def test_a_stop_signal_ends_the_trackers_interrupted(tmp_path):
    def stop_at_step_2(message: str) -> None:
        if message.startswith("step 2/"):
            os.kill(os.getpid(), signal.SIGTERM)

    with Trainer(tiny_run_config(tmp_path, probes(("p", ""))), log=stop_at_step_2) as trainer:
        trainer.run()
    assert CALLS["p"][-1] == ("finish", RunStatus(state="interrupted", step=2))
    assert latest_checkpoint(tmp_path).name == "step_2"


# ---------------------------------------------------------------------------------------------------------------------
# Failures


@pytest.mark.parametrize("where", ["start", "log", "finish"])
def test_a_failing_tracker_is_reported_once_and_the_run_and_the_others_go_on(tmp_path, where):
    messages = train_tiny(
        tiny_run_config(tmp_path, probes(("bad", f", fail_in: {where}"), ("good", "")), "training.train_iters=4")
    )
    reports = [message for message in messages if message.startswith("tracker ")]
    assert reports == [
        f"tracker 'bad' failed: OSError: no space left on device (in {where}); the run trains on without it "
        "(training.trackers_required: true stops it instead)"
    ]
    assert len(calls("bad", "log")) == {"start": 0, "log": 1, "finish": 4}[where]
    assert [step for _, step, _ in calls("good", "log")] == [1, 2, 3, 4] and len(calls("good", "finish")) == 1
    assert sorted(logged_figures(tmp_path)) == [1, 2, 3, 4]
    assert latest_checkpoint(tmp_path).name == "step_4"


@pytest.mark.parametrize("where", ["start", "log", "finish"])
def test_with_trackers_required_a_failing_tracker_stops_the_run_naming_it(tmp_path, where):
    config = tiny_run_config(tmp_path, probes(("bad", f", fail_in: {where}")), "training.trackers_required=true")
    with pytest.raises(TrainingError) as error:
        train_tiny(config)
    assert str(error.value) == (
        f"tracker 'bad' failed: OSError: no space left on device (in {where}) (training.trackers_required is set)"
    )
    if where == "start":  # before any step
        assert latest_checkpoint(tmp_path) is None and calls("bad", "log") == []


def test_a_tracker_that_cannot_be_built_is_a_failure_like_any_other(tmp_path, blockzoo_registry):
    register_plugin(plugin_registering("broken.tracker", BrokenTrackerConfig, "Missing"), "broken")
    messages = train_tiny(tiny_run_config(tmp_path, "training.trackers={b: {type: broken.tracker}}"))
    assert [m for m in messages if m.startswith("tracker ")] == [
        f"tracker 'b' failed: AttributeError: module '{__name__}' has no attribute 'Missing'; the run trains on "
        "without it (training.trackers_required: true stops it instead)"
    ]


def release_at_the_end(messages: list[str]):
    """A run's log that, at step 2, waits until the tracker sits in its first log call (its thread takes calls
    within `tracking.BATCH_SECONDS`), and releases the blocked trackers once the run has saved its last checkpoint
    (step 8)."""

    def log(message: str) -> None:
        messages.append(message)
        if message.startswith("step 2/"):
            deadline = time.monotonic() + 30
            while not calls("slow", "log") and time.monotonic() < deadline:
                time.sleep(0.01)
        if message.startswith("saved checkpoint") and message.endswith("step_8"):
            messages.append(f"while the loop ran, the tracker had: {len(calls('slow', 'log'))} logs")
            RELEASE.set()

    return log


def test_a_blocked_tracker_does_not_hold_the_steps(tmp_path):
    messages: list[str] = []
    config = tiny_run_config(tmp_path, probes(("slow", ", block_in_log: true")))
    train_tiny(config, log=release_at_the_end(messages))
    # every step trained and checkpointed while the tracker sat in its first log call
    assert "while the loop ran, the tracker had: 1 logs" in messages
    assert [step for _, step, _ in calls("slow", "log")] == list(range(1, 9)) and len(calls("slow", "finish")) == 1
    assert not [message for message in messages if message.startswith("tracker ")]


def test_a_tracker_that_falls_behind_loses_entries_said_once(tmp_path, monkeypatch):
    monkeypatch.setattr(tracking, "QUEUE_SIZE", 2)
    messages: list[str] = []
    # jsonl off: with a queue of 2 on a loaded machine, it may fall behind too
    trackers = "training.trackers={jsonl: null, slow: {type: probe.tracker, block_in_log: true}}"
    config = tiny_run_config(tmp_path, trackers)
    train_tiny(config, log=release_at_the_end(messages))
    reports = [message for message in messages if message.startswith("tracker ")]
    assert reports == [
        "tracker 'slow' failed: fell behind by 2 logged steps (entries dropped); the run trains on without it "
        "(training.trackers_required: true stops it instead)"
    ]
    assert [step for _, step, _ in calls("slow", "log")] == [1]  # then failed: its queued calls are not made
    assert latest_checkpoint(tmp_path).name == "step_8"  # the run trained on


def test_a_tracker_that_does_not_finish_is_left_behind_and_said(tmp_path, monkeypatch):
    monkeypatch.setattr(tracking, "FINISH_SECONDS", 0.5)
    messages = train_tiny(
        tiny_run_config(tmp_path, probes(("stuck", ", hang_in_finish: true")), "training.train_iters=2")
    )
    assert [m for m in messages if m.startswith("tracker ")] == [
        "tracker 'stuck' failed: did not finish within 0.5 s (left running in the background); the run trains on "
        "without it (training.trackers_required: true stops it instead)"
    ]


def test_with_trackers_required_a_tracker_that_takes_no_entry_stops_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(tracking, "QUEUE_SIZE", 2)
    monkeypatch.setattr(tracking, "WAIT_SECONDS", 0.5)
    monkeypatch.setattr(tracking, "FINISH_SECONDS", 0.5)
    config = tiny_run_config(tmp_path, probes(("slow", ", block_in_log: true")), "training.trackers_required=true")
    with pytest.raises(TrainingError) as error:
        train_tiny(config)
    assert str(error.value) == (
        "tracker 'slow' failed: took no entry for 0.5 s (its queue of 2 is full) (training.trackers_required is set)"
    )
