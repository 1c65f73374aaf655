"""The training loop: `blockzoo train CONFIG` (one process, or every rank under `torchrun`). The run is set up
before by `blockzoo.training.setup.prepare_run`; a step's loss is `blockzoo.training.loss`'s, its
gradient norm `blockzoo.training.gradients`'.

SIGTERM or SIGINT (what a cluster scheduler sends) ends the run at the next step boundary, every rank agreeing (an
all-reduce of a flag): a checkpoint is saved, and the run returns (`blockzoo train` exits 0). A second signal stops
at once (`Stopped`): a save under way is abandoned, its `.partial` directory removed.
"""

from __future__ import annotations

import contextlib
import functools
import math
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

from blockzoo.checkpoint import NonFiniteError
from blockzoo.data.dataset import TrainingBatches
from blockzoo.distributed import debug
from blockzoo.distributed.runtime import Distributed
from blockzoo.run_config import RunConfig
from blockzoo.training.evaluation import data_rank, evaluate
from blockzoo.training.export import export_checkpoint
from blockzoo.training.graphs import StepGraph
from blockzoo.training.loss import forward_backward
from blockzoo.training.optimizer import learning_rate
from blockzoo.training.progress import Progress, write_line
from blockzoo.training.reporting import Throughput, metrics_entry, peak_flops, start_lines, step_line
from blockzoo.training.run_trackers import finish_trackers, start_trackers
from blockzoo.training.saving import save_run_checkpoint
from blockzoo.training.setup import RunSetup, prepare_run
from blockzoo.training.signals import Stopped, StopSignals, TrainingError
from blockzoo.training.step import PlacedMicroBatch, StepDataReader, StepFigures, to_host
from blockzoo.training.tracking import RunStatus, Trackers, TrackingError

__all__ = ["StepRecord", "Stopped", "Trainer", "TrainingError"]

STOPPED_TRACKER_SECONDS = 10.0  # a second stop signal asks to stop at once: trackers get this long to finish


@attrs.define
class StepRecord:
    step: int
    loss: float
    learning_rate: float
    gradient_norm: float
    losses: dict[str, float] = attrs.field(factory=dict)


class Trainer:
    """Runs the training of a run config (`run`): set up by `prepare_run` (or given a `RunSetup` made by it)."""

    def __init__(
        self,
        run_config: RunConfig | None = None,
        *,
        distributed: Distributed | None = None,
        log: Callable[[str], None] | None = None,
        setup: RunSetup | None = None,
    ):
        self._log = log or _print
        self.setup = setup = setup or prepare_run(run_config, distributed=distributed, log=self._log)
        self.run_config, self.config = setup.run_config, setup.run_config.training
        self.output_dir = Path(self.config.output_dir)
        self.distributed, self.model, self.pipeline = setup.distributed, setup.model, setup.pipeline
        self.optimizer, self.data, self.harness = setup.optimizer, setup.data, setup.harness
        self.memory, self.debug, self.base = setup.memory, setup.debug, setup.base
        self.resumed_from = setup.resumed_from
        self.last_checkpoint = setup.resumed_from  # the latest this run can count on: said when it stops
        self.step, self.data_position = setup.step, setup.data_position
        # The forward and backward passes of a step's micro-batches (`blockzoo.training.loss.forward_backward`): a
        # partial, so that the step calls the loss with no frame of the trainer's between them.
        self.forward_backward = functools.partial(forward_backward, self.model, self.pipeline, self.distributed)
        self._gradients: Callable[[list[PlacedMicroBatch]], tuple[torch.Tensor, tuple[str, ...]]] = self._step_gradients
        if self.config.cuda_graphs:
            self._gradients = StepGraph(self._step_gradients, setup.trainable, self.log)
        self._steps = StepDataReader(
            self.model, self.distributed, self.config.gradient_accumulation, bucketed=self.config.cuda_graphs
        )
        self.history: list[StepRecord] = []
        self._unread: list[StepFigures] = []  # steps whose figures are still on the device (see `_read_figures`)
        self.evaluations: list[tuple[int, float]] = []

    def close(self) -> None:
        """Shut down the process group if this trainer started it (safe to call twice)."""
        if self.setup.owns_distributed:
            self.distributed.shutdown()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def log(self, message: str) -> None:
        if self.distributed.rank == 0:
            self._log(message)

    def _kept(self) -> str:
        last = self.last_checkpoint
        return f"the last checkpoint ({last}) is intact" if last else "no checkpoint was written"

    def run(self) -> list[StepRecord]:
        """Train to `train_iters` (or, after SIGTERM / SIGINT, to the next step boundary, saving there)."""
        bar = Progress(total=self.config.train_iters, initial=self.step, enabled=self._shows_progress())
        with StopSignals(self.log) as signals, bar as self._progress, self._trackers_finished(signals):
            trained = self.step < self.config.train_iters
            data_size, resumed_from = self.distributed.data_size, self.resumed_from
            for line in start_lines(self.model, self.run_config, data_size, step=self.step, resumed_from=resumed_from):
                self.log(line)
            if not trained:
                return self.history
            if self.distributed.rank == 0:
                self._trackers = start_trackers(self.run_config, self.model, self.step, self.log)
            started = time.perf_counter()
            batches = self.data.training_batches(**data_rank(self.distributed), position=self.data_position)
            timer = Throughput(peak_flops(self.config.peak_tflops, self.distributed))
            self.model.train()  # and again after each evaluation
            self._upcoming = self._steps.next(batches)
            while self.step < self.config.train_iters:
                current = self._upcoming
                # The next step's data is read and placed while this step's work runs on the device.
                more = self.step + 1 < self.config.train_iters
                self._train_step(
                    current.micro_batches, prefetch=functools.partial(self._prefetch, batches) if more else None
                )
                self.step += 1
                self.data_position = current.position
                timer.add(current.tokens, current.flops)
                last = self.step == self.config.train_iters
                logs = self.step % self.config.log_interval == 0 or last
                evaluation = self.config.evaluation
                evaluates = bool(evaluation.interval) and (self.step % evaluation.interval == 0 or last)
                if logs or evaluates:  # what the host reports must be checked first
                    self._read_figures()
                entry = {}  # this step's line of the metrics file, if it logs anything
                if logs:
                    record = self.history[-1]
                    timer.stop()
                    self.log(step_line(record, self.config.train_iters, timer))
                    entry = metrics_entry(record, self.step * current.tokens, time.perf_counter() - started, timer)
                    timer.reset()
                if evaluates:
                    tokens = self.step * current.tokens
                    entry = {"step": self.step, "tokens": tokens, **entry, **self._evaluate()}
                if self.harness is not None and self.harness.due(self.step, last):
                    benchmark = self.harness.run(self.model, step=self.step, output_dir=self.output_dir, log=self.log)
                    entry = {"step": self.step, "tokens": self.step * current.tokens, **entry, **benchmark}
                if entry and (source_tokens := self.data.source_tokens(self.data_position)) is not None:
                    entry["source_tokens"] = source_tokens  # a blend's tokens per source, from the position alone
                if entry:
                    self._record(entry)
                self._progress.advance(self.history[-1].loss if logs else None)
                interval = self.config.checkpoint_interval
                stop = signals.any_rank_received(self.distributed)
                if (interval and self.step % interval == 0) or last or stop:
                    self._read_figures()  # what a checkpoint keeps must be checked first
                    directory = self.save()
                if stop and not last:
                    self.log(
                        f"stopped at step {self.step} on a signal; checkpoint {directory} saved: the run resumes there"
                    )
                    return self.history
            if self.config.export_format is not None:
                self.export()
            return self.history

    @contextlib.contextmanager
    def _trackers_finished(self, signals: StopSignals) -> Iterator[None]:
        """Around the run: the trackers (started by `run` on rank 0) hear how it ended, whichever way it did."""
        self._trackers: Trackers | None = None
        try:
            yield
        except Stopped as stopped:
            name = signal.Signals(stopped.signal_number).name
            message = f"stopped at once by a second {name}; {self._kept()}"
            self._finish_trackers("interrupted", message, failing=True, seconds=STOPPED_TRACKER_SECONDS)
            raise Stopped(stopped.signal_number, message) from None
        except TrackingError as error:  # a required tracker failed
            self._finish_trackers("failed", str(error), failing=True)
            raise TrainingError(str(error)) from None
        except BaseException as error:
            self._finish_trackers("failed", f"{type(error).__name__}: {error}", failing=True)
            raise
        self._finish_trackers("interrupted" if signals.received is not None else "finished")

    def _finish_trackers(
        self, state: str, message: str | None = None, *, failing: bool = False, seconds: float | None = None
    ) -> None:
        trackers, self._trackers = self._trackers, None
        finish_trackers(trackers, RunStatus(state=state, step=self.step, message=message), seconds, failing, self.log)

    def _record(self, entry: dict[str, Any]) -> None:
        """A logged step's figures (training, evaluation or both): to the trackers (`metrics.jsonl`, ...), on rank 0."""
        if self._trackers is not None:
            self._trackers.log(entry["step"], entry)

    def _prefetch(self, batches: TrainingBatches) -> None:
        self._upcoming = self._steps.next(batches)

    def _shows_progress(self) -> bool:
        """A progress bar on rank 0 when the log is the terminal's (the bar itself needs stderr to be one)."""
        return self.distributed.rank == 0 and self._log is _print

    def _train_step(self, micro_batches: list[PlacedMicroBatch], prefetch: Callable[[], None] | None = None) -> None:
        """One optimizer step over this rank's `micro_batches`; its figures wait on the device (`_read_figures`).
        `prefetch` runs once the step's work is queued on the device."""
        rate = learning_rate(
            self.step,
            peak=self.config.optimizer.learning_rate,
            train_iters=self.config.train_iters,
            schedule=self.config.schedule,
        )
        self.optimizer.set_learning_rate(rate)
        values, names = self._gradients(micro_batches)
        cross_entropy, norm = values[0], values[1]
        self._unread.append(StepFigures(step=self.step + 1, learning_rate=rate, names=names, values=values))
        # The weights must stay finite. An optimizer that skips its update on the device after a non-finite loss or
        # norm (and every later update: the run stops when the host reads the figures) lets the host read them at
        # the next log line; otherwise the update waits for the host's check.
        on_device = getattr(self.optimizer, "skips_non_finite_on_device", False)
        if on_device:
            self.optimizer.skip_unless_finite(cross_entropy, norm)
            self.optimizer.step()
        if prefetch is not None:
            prefetch()
        if not on_device:
            self._read_figures()
            self.optimizer.step()
        if self.debug is not None:
            debug.after_step(self.model, self.distributed, self.step + 1)

    def _step_gradients(self, micro_batches: list[PlacedMicroBatch]) -> tuple[torch.Tensor, tuple[str, ...]]:
        """The step's gradients, reduced and clipped, in the parameters' `.grad`; returns its figures on the device
        (loss, gradient norm, named losses: `StepFigures.values`) and the named losses' names. What a CUDA graph
        captures (`training.cuda_graphs`)."""
        self.optimizer.zero_grad(set_to_none=True)
        cross_entropy, named = self.forward_backward(micro_batches)
        self.distributed.reduce_replicated_gradients(self.setup.trainable)
        norm = self.setup.gradient_norm.clip(self.setup.trainable, self.config.gradient_clipping)
        return torch.stack([cross_entropy, norm, *named.values()]).detach().float(), tuple(named)

    def _read_figures(self) -> None:
        """The figures of the steps not read yet, in one transfer from the device, checked and added to `history`:
        a non-finite loss or gradient norm stops the run (`TrainingError`), naming the first step that had one."""
        unread, self._unread = self._unread, []
        if not unread:
            return
        values = iter(to_host([figures.values for figures in unread]))
        for figures in unread:
            loss, norm, *named = (next(values) for _ in range(2 + len(figures.names)))
            self._check_finite("loss", loss, figures.step)
            self._check_finite("gradient norm", norm, figures.step)
            losses = dict(zip(figures.names, named))
            self.history.append(StepRecord(figures.step, loss, figures.learning_rate, norm, losses))

    def _check_finite(self, what: str, value: float, step: int) -> None:
        if not math.isfinite(value):
            raise TrainingError(f"the {what} is {value} at step {step}; stopping, {self._kept()}")

    def _evaluate(self) -> dict[str, float]:
        """This step's evaluation figures, as the metrics file names them (`evaluation.evaluate`)."""
        figures = evaluate(self.model, self.pipeline, self.distributed, self.setup.evaluation_sets, self.config)
        if "evaluation_loss" in figures:
            self.evaluations.append((self.step, figures["evaluation_loss"]))
        described = ", ".join(f"{name.removeprefix('evaluation_')} {loss:.4f}" for name, loss in figures.items())
        self.log(f"evaluation at step {self.step}: {described}")
        return figures

    def save(self) -> Path:
        """Save `step_<N>` (every rank), then prune to `checkpoint_keep`. A weight (or optimizer state) that is not
        finite stops the run (`TrainingError`) with nothing written."""
        try:
            self.last_checkpoint = save_run_checkpoint(self.setup, self.step, self.data_position)
        except NonFiniteError as error:
            raise TrainingError(f"after step {self.step}, {error}; stopping, {self._kept()}") from None
        return self.last_checkpoint

    def export(self) -> Path:
        """Convert the latest checkpoint to `training.export_format` (rank 0 writes; the others wait for it)."""
        return export_checkpoint(self.last_checkpoint, self.config, self.distributed, self.log)


def _print(message: str) -> None:
    write_line(message)  # above the progress bar, if there is one
