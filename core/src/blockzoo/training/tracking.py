"""Trackers: where a run's figures go (`training.trackers`; docs/tracking.md). Torch-free.

A tracker is a plugin type of kind `tracker`: a `TrackerConfig` subclass and a `Tracker` subclass, registered through
`register_components` like any kind. The core's own is `jsonl` (`metrics.jsonl`); `tensorboard`, `wandb` and
`mlflow` are their own distributions. Rank 0 runs them; no other rank writes.

A tracker never stops or slows the training unless the run asks for it (`training.trackers_required`): each runs on
its own background thread, fed through a bounded queue, so a slow `wandb.init` or a network stall costs the training
loop a queue put; one with `separate_process` (the first-party trackers of other libraries) does its work in a child
process, its thread forwarding the calls (`blockzoo.training.tracker_process`). A tracker that fails (its library
missing, its directory not writable, an exception in it) is reported once, on the training's own log, and is not
called again; a tracker that falls behind by a whole queue loses entries (said once) rather than holding the step.
With `trackers_required`, any failure is a `TrackingError` naming the tracker, raised in the training loop at the
next call; the trackers' start is waited for before the first step, and a full queue waits instead of dropping (each
at most `WAIT_SECONDS`, then a failure too).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import attrs

from blockzoo.plugins import get_registry
from blockzoo.training.tracking_config import TrackerConfig

QUEUE_SIZE = 1024  # logged steps a tracker may fall behind by before its entries are dropped
FINISH_SECONDS = 120.0  # how long the end of a run waits for a tracker to write what it holds and finish
WAIT_SECONDS = 120.0  # with trackers_required: how long a start, or a full queue, may hold the run
BATCH_SECONDS = 0.1  # how often a busy tracker thread takes the calls that arrived: figures are at most this late


@attrs.frozen(kw_only=True)
class TrackerRun:
    """What a tracker learns when the run starts: `config`, the resolved run config as plain data (as in a
    checkpoint's `config.yaml`); `parameters`, the model's parameters per kind of layer (`{"mixer attention":
    {"parameters": ..., "layers": ...}, ..., "total": {...}}`); `output_dir`, the run's directory; `start_step`, 0 or
    the step of the checkpoint the run resumes from (the figures of later steps that an earlier run logged are
    superseded by this run's); `name`, the tracker's name in `training.trackers`."""

    config: dict[str, Any]
    parameters: dict[str, dict[str, int]]
    output_dir: Path
    start_step: int
    name: str

    def history(self) -> list[dict[str, Any]] | None:
        """The entries of the run's `metrics.jsonl` up to `start_step`, in order: what a tracker that cannot take
        figures back replays into a new run of its own, superseding the run an earlier process wrote past its
        checkpoint. None when the run has no metrics file (`jsonl` turned off)."""
        from blockzoo.training.metrics import METRICS_FILE, read_metrics  # it imports this module

        path = self.output_dir / METRICS_FILE
        if not path.is_file():
            return None
        return [entry for entry in read_metrics(path) if entry["step"] <= self.start_step]


@attrs.frozen(kw_only=True)
class RunStatus:
    """How a run ended: `state` is `finished`, `failed` (`message` says why) or `interrupted` (a stop signal; the run
    saved a checkpoint and resumes there, or a second signal stopped it at once); `step`, the last step trained."""

    state: Literal["finished", "failed", "interrupted"]
    step: int
    message: str | None = None


class Tracker:
    """Base of a tracker implementation. The run calls `start` once, `log` at every logged step, `finish` once, all
    on one background thread of rank 0 (in that order). Any exception is the tracker's failure: reported once, and
    the tracker is not called again (unless `training.trackers_required`, which stops the run)."""

    def __init__(self, config: TrackerConfig):
        self.config = config

    def start(self, run: TrackerRun) -> None:
        """The run starts (or resumes at `run.start_step`): open the tracker's run, record the config."""

    def log(self, step: int, entry: Mapping[str, Any]) -> None:
        """A logged step's figures, the line `metrics.jsonl` gets: `step`, `tokens`, `seconds`, `loss`,
        `learning_rate`, `gradient_norm`, `tokens_per_second`, `tflops`, `mfu`, memory figures, named per-layer losses,
        `source_tokens` (a mapping of source names to tokens), evaluation figures; each when present.
        `scalar_figures(entry)` gives them as flat names to numbers."""

    def finish(self, status: RunStatus) -> None:
        """The run ends (`status`): write what is held, close the tracker's run."""


def scalar_figures(entry: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of a logged entry by flat name, for trackers that take scalars: nested mappings joined with `/`
    (`source_tokens/web`), `step` left out (it is the x-axis), booleans and non-numbers left out."""
    figures: dict[str, float] = {}
    for key, value in entry.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            figures.update(scalar_figures(value, prefix=f"{name}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and name != "step":
            figures[name] = value
    return figures


class TrackerRunFile:
    """A tracker's own record in the run's directory (a small JSON file), for trackers whose run lives elsewhere (a
    server, a database): the id of that run, so a resumed run continues it, and the last step sent to it, so a
    resumed run knows whether an earlier process sent steps past the checkpoint (such trackers cannot take back a
    figure: they supersede that run with a new one, `TrackerRun.history` replayed into it). Written atomically."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.data: dict[str, Any] = json.loads(self.path.read_text()) if self.path.exists() else {}

    @classmethod
    def of(cls, run: TrackerRun) -> TrackerRunFile:
        """The record of the tracker `run.name` of this run: `<output_dir>/trackers/<name>.json`."""
        return cls(run.output_dir / "trackers" / f"{run.name}.json")

    @property
    def run_id(self) -> str | None:
        return self.data.get("run_id")

    @property
    def last_step(self) -> int:
        return int(self.data.get("last_step", 0))

    def supersede(self, run_id: str, *, step: int) -> str | None:
        """Record `run_id` as the tracker's run from now on, holding the steps up to `step`; the superseded run's
        id (also kept in the record's `superseded` list), or None if there was none."""
        old = self.run_id
        superseded = [*self.data.get("superseded", []), *([old] if old else [])]
        self.update(run_id=run_id, last_step=step, superseded=superseded)
        return old

    def update(self, **values: Any) -> None:
        self.data.update(values)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps(self.data))
        os.replace(partial, self.path)


class TrackingError(RuntimeError):
    """A tracker failed and `training.trackers_required` is set; the message names the tracker."""

    exit_code = 1


_FINISH = object()  # sentinel: the worker has finished its tracker and ends


class _Worker:
    """One tracker on its own daemon thread: calls arrive through a bounded queue and run in order."""

    def __init__(self, name: str, tracker: Tracker | None, *, blocking: bool):
        self.name = name
        self.tracker = tracker
        self.blocking = blocking
        self.failure: str | None = None
        self.reported = False
        self.dropped = 0
        self._calls: queue.Queue = queue.Queue(QUEUE_SIZE)
        self._thread = threading.Thread(target=self._serve, name=f"tracker {name}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        # An idle thread waits (costing nothing) and takes a first call at once; then it takes what arrived every
        # `BATCH_SECONDS` until nothing did: a thread waiting in `get` is woken by every put, taking the interpreter
        # from the training loop once per logged step.
        while True:
            calls = [self._calls.get()]
            while calls:
                for call in calls:
                    if not self._call(call):
                        return
                time.sleep(BATCH_SECONDS)
                calls = self._arrived()

    def _arrived(self) -> list[Any]:
        calls = []
        with contextlib.suppress(queue.Empty):
            while True:
                calls.append(self._calls.get_nowait())
        return calls

    def _call(self, call: Any) -> bool:
        """Make one call (unless the tracker failed already); False for the end."""
        try:
            if call is _FINISH:
                return False
            if self.failure is None:
                call()
        except BaseException as error:  # noqa: BLE001 - a tracker's failure is reported, never raised here
            self.failure = f"{type(error).__name__}: {error}"
        finally:
            self._calls.task_done()
        return True

    def submit(self, call: Callable[[], None]) -> None:
        if self.failure is not None:
            return
        try:
            if self.blocking:
                self._calls.put(call, timeout=WAIT_SECONDS)
            else:
                self._calls.put_nowait(call)
        except queue.Full:
            if self.blocking:
                self.failure = f"took no entry for {WAIT_SECONDS:g} s (its queue of {QUEUE_SIZE} is full)"
            self.dropped += 1

    def wait(self, seconds: float | None) -> bool:
        """Whether the calls submitted so far are done within `seconds` (None: however long they take)."""
        done = threading.Event()
        threading.Thread(target=lambda: (self._calls.join(), done.set()), daemon=True).start()
        return done.wait(seconds)

    def stop(self) -> None:
        with contextlib.suppress(queue.Full):  # a tracker still stuck in a call keeps its thread: a daemon
            self._calls.put_nowait(_FINISH)


class Trackers:
    """The run's trackers, fed from the training loop (rank 0). `report` is the run's log (one line per problem)."""

    def __init__(
        self,
        configs: Mapping[str, TrackerConfig],
        run_for: Callable[[str], TrackerRun],
        *,
        required: bool,
        report: Callable[[str], None],
    ):
        self.required = required
        self._report = report
        self._workers = []
        for name, config in configs.items():
            try:
                tracker = get_registry().implementation_of(config)(config)
                if config.separate_process:  # the same tracker, built and called in a child process
                    from blockzoo.training.tracker_process import ChildProcessTracker

                    tracker = ChildProcessTracker(config)
            except Exception as error:  # noqa: BLE001 - its failure, reported below like any other
                worker = _Worker(name, None, blocking=required)
                worker.failure = f"{type(error).__name__}: {error}"
            else:
                worker = _Worker(name, tracker, blocking=required)
                worker.submit(functools.partial(tracker.start, run_for(name)))
            self._workers.append(worker)
        if required:  # a tracker the run needs must have started before the first step
            for worker in self._workers:
                if not worker.wait(WAIT_SECONDS) and worker.failure is None:
                    worker.failure = f"did not start within {WAIT_SECONDS:g} s"
        self.check()

    def log(self, step: int, entry: Mapping[str, Any]) -> None:
        entry = dict(entry)  # the trackers' own copy: the loop may reuse its dict
        for worker in self._workers:
            if worker.tracker is not None:
                worker.submit(functools.partial(worker.tracker.log, step, entry))
        self.check()

    def finish(self, status: RunStatus, seconds: float | None = None) -> None:
        """Every tracker writes what it holds and finishes, all within `seconds` (default `FINISH_SECONDS`); one still
        busy then is left on its daemon thread (a failure)."""
        seconds = FINISH_SECONDS if seconds is None else seconds
        deadline = time.monotonic() + seconds
        for worker in self._workers:
            if worker.tracker is not None:
                worker.submit(functools.partial(worker.tracker.finish, status))
        for worker in self._workers:
            if not worker.wait(max(0.0, deadline - time.monotonic())) and worker.failure is None:
                worker.failure = f"did not finish within {seconds:g} s (left running in the background)"
            worker.stop()
        self.check()

    def check(self) -> None:
        """Report each new failure once (or, with `required`, raise it)."""
        for worker in self._workers:
            if worker.dropped and not worker.reported and worker.failure is None:
                worker.failure = f"fell behind by {QUEUE_SIZE} logged steps (entries dropped)"
            if worker.failure is None or worker.reported:
                continue
            worker.reported = True
            message = f"tracker {worker.name!r} failed: {worker.failure}"
            if self.required:
                raise TrackingError(f"{message} (training.trackers_required is set)")
            self._report(f"{message}; the run trains on without it (training.trackers_required: true stops it instead)")
