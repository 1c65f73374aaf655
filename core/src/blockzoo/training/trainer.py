"""The training loop: `blockzoo train CONFIG` (one process, or every rank under `torchrun`).

One optimizer step takes `gradient_accumulation` micro-batches on each data-parallel rank. The loss
is the cross-entropy summed over every labelled token of the step (all micro-batches, all ranks)
divided by their count, plus the layers' named losses averaged over the micro-batches of all ranks,
so the gradients do not depend on how the step is split. Each rank's backward pass covers its share
of that sum: gradients of replicated parameters that saw token shards (sequence-tensor-parallel) are
summed over the tensor group, then all gradients are summed over the data-parallel ranks.

Under sequence-data parallelism the sequence-data ranks of one data rank read the same micro-batches and each runs
its slices of them (`step.place_micro_batch`): each computes the cross-entropy of its own tokens (summed, like the
labelled-token count, over data × sequence_data), and the named losses of the whole micro-batch, the same on each
(summed over the data ranks only); gradients are summed over data × sequence_data (FSDP's folded mesh).

SIGTERM or SIGINT (what a cluster scheduler sends) ends the run at the next step boundary, every rank agreeing (an
all-reduce of a flag): a checkpoint is saved, and the run returns (`blockzoo train` exits 0). A second signal stops
at once (`Stopped`): a save under way is abandoned, its `.partial` directory removed.
"""

from __future__ import annotations

import functools
import itertools
import math
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn

from blockzoo.benchmarks.run import HarnessRunner
from blockzoo.checkpoint import (
    METADATA_FILE,
    ORIGIN_DIRECTORY,
    CheckpointError,
    NonFiniteError,
    keep_last,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint_metadata,
    read_origin,
    save_checkpoint,
)
from blockzoo.config import to_dict
from blockzoo.conversion import get_format
from blockzoo.data.dataset import Dataset, TrainingBatches, build_dataset
from blockzoo.data.errors import DatasetError
from blockzoo.distributed import debug
from blockzoo.distributed.consistency import check_ranks_agree
from blockzoo.distributed.data_parallel import is_sharded, prepare_micro_batch, reshard
from blockzoo.distributed.parallelize import parallelize
from blockzoo.distributed.pipeline import Pipeline, build_pipeline_model
from blockzoo.distributed.runtime import Distributed, local_tensor
from blockzoo.errors import UsageError
from blockzoo.layers.base import Batch
from blockzoo.layers.parameter import uninitialized
from blockzoo.model.factory import (
    base_reference,
    convert,
    load_base,
    load_pretrained_weights,
    pretrained_origin,
    with_pretrained_config,
)
from blockzoo.model.language_model import LanguageModel
from blockzoo.model.tokenizer import model_tokenizer
from blockzoo.plugins import get_registry
from blockzoo.run_config import RunConfig
from blockzoo.training.graphs import StepGraph, check_cuda_graphs_possible
from blockzoo.training.optimizer import learning_rate, unique_trainable
from blockzoo.training.progress import Progress, write_line
from blockzoo.training.random_state import random_states, restore_random_states
from blockzoo.training.reporting import (
    Throughput,
    memory_report,
    memory_usage,
    metrics_entry,
    parameter_counts,
    parameters_line,
    peak_flops,
    step_line,
    tokens_line,
)
from blockzoo.training.step import PlacedMicroBatch, StepData, StepFigures, place_micro_batch, to_host
from blockzoo.training.tracking import RunStatus, TrackerRun, Trackers, TrackingError
from blockzoo.training.tracking_config import active_trackers

STOPPED_TRACKER_SECONDS = 10.0  # a second stop signal asks to stop at once: trackers get this long to finish


class TrainingError(RuntimeError):
    """The run cannot go on (a non-finite loss, ...); the last checkpoint is intact."""

    exit_code = 1


class Stopped(TrainingError):
    """A second SIGTERM / SIGINT stopped the run at once."""

    def __init__(self, signal_number: int, message: str = ""):
        self.signal_number = signal_number
        self.exit_code = 128 + signal_number  # the shell's convention for a process ended by a signal
        super().__init__(message or f"stopped by a second {signal.Signals(signal_number).name}")


class _StopSignals:
    """While active (a context manager, in the main thread): the first SIGTERM / SIGINT is recorded (`received`),
    a second raises `Stopped`. The previous handlers come back on exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, log: Callable[[str], None]):
        self._log = log
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, number: int, _frame: object) -> None:
        if self.received is not None:
            raise Stopped(number)
        self.received = number
        self._log(
            f"received {signal.Signals(number).name}: saving a checkpoint at the end of this step, then stopping "
            "(a second signal stops at once)"
        )

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            for number in self.SIGNALS:
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)


@attrs.define
class StepRecord:
    step: int
    loss: float
    learning_rate: float
    gradient_norm: float
    losses: dict[str, float] = attrs.field(factory=dict)


class Trainer:
    def __init__(
        self, run_config: RunConfig, *, distributed: Distributed | None = None, log: Callable[[str], None] | None = None
    ):
        self.output_dir = Path(run_config.training.output_dir)
        run_config, pretrained = self._resolve_pretrained(run_config)
        self.run_config = run_config
        self.config = run_config.training
        # A Distributed made here is this trainer's to shut down (`close`, or `with Trainer(...) as trainer`).
        self._owns_distributed = distributed is None
        self.distributed = distributed or Distributed(run_config.distributed)
        self._log = log or _print
        check_ranks_agree(run_config, self.distributed)  # different versions, plugins or configs refuse to start
        if self.config.export_format is not None:  # refuse a model the format cannot hold before training it
            get_format(self.config.export_format).check_model_config(run_config.model)
        torch.manual_seed(run_config.distributed.seed)
        last = latest_checkpoint(self.output_dir, report=self.log)  # a corrupted newer one is skipped, and said
        self.resumed_from = last
        with uninitialized(pretrained is not None or last is not None):  # the checkpoint has every weight
            if run_config.distributed.pipeline_parallel > 1:  # this rank's stages only
                self.model = build_pipeline_model(run_config.model, self.distributed)
            else:
                self.model = LanguageModel(run_config.model, self.distributed)
        # The base a PEFT run's checkpoints refer to instead of holding its weights (None: they hold every weight). A
        # resumed run keeps its checkpoints' kind, unless checkpoint_base_weights now asks for every weight.
        self._resumed_base = read_checkpoint_metadata(last).get("base") if last else None
        if self._resumed_base:  # the latest holds adapters only: the base weights from its base (if unchanged)
            load_base(self.model, last, self._resumed_base, self.distributed)
        self.base: dict[str, Any] | None = None if self.config.checkpoint_base_weights else self._resumed_base
        if pretrained is not None:
            if run_config.model.peft is not None and not self.config.checkpoint_base_weights:
                self.base = base_reference(pretrained)
            load_pretrained_weights(self.model, pretrained, self.distributed)
            self.model.origin = pretrained_origin(pretrained)
            self.log(f"initialized from {pretrained}")
        self.pipeline = Pipeline(self.model, self.distributed) if run_config.distributed.pipeline_parallel > 1 else None
        stages = None if self.pipeline is None else self.pipeline.modules
        parallelize(self.model, run_config, stages)  # recomputation, compilation, then ZeRO: new parameter objects
        self.debug = debug.install(self.model, self.distributed) if run_config.distributed.debug else None
        optimizer_class = get_registry().implementation_of(self.config.optimizer)
        self.optimizer = optimizer_class(self.config.optimizer, self.model.parameters())
        # Walked once, not per step: a step of a small model is bound by the host's work.
        self._trainable = unique_trainable(self.model.parameters())
        self._norm_groups = self._gradient_norm_groups()
        self._gradients: Callable[[list[PlacedMicroBatch]], tuple[torch.Tensor, tuple[str, ...]]] = self._step_gradients
        if self.config.cuda_graphs:
            problem = check_cuda_graphs_possible(self.distributed.device, self.distributed.world_size)
            if problem is not None:
                raise UsageError(problem)
            self._gradients = StepGraph(self._step_gradients, self._trainable, self.log)
        self.memory = memory_usage(self.model, self.optimizer, run_config.distributed.zero_stage)
        self.log(memory_report(self.memory, self.distributed))
        self.data = build_dataset(
            run_config.data,
            seed=run_config.distributed.seed,
            model_vocab_size=run_config.model.embeddings.vocab_size,
            log=self.log,
        )
        self._evaluation_sets = self._build_evaluation_sets()
        self.harness = self._harness_runner()
        self.step = 0
        self._flops_by_lengths: dict[tuple[int, ...], int] = {}
        self.data_position: Any = None
        self.history: list[StepRecord] = []
        self._unread: list[StepFigures] = []  # steps whose figures are still on the device (see `_read_figures`)
        self.evaluations: list[tuple[int, float]] = []
        self._resume(last)

    def close(self) -> None:
        """Shut down the process group if this trainer started it (safe to call twice)."""
        if self._owns_distributed:
            self.distributed.shutdown()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _resolve_pretrained(self, run_config: RunConfig) -> tuple[RunConfig, str | None]:
        """With `model.pretrained`: the run config with the checkpoint's model (updated with the model fields given),
        and where to take the initial weights from (None when resuming: the latest checkpoint has them, and its
        config is the one to start from)."""
        source = run_config.model.pretrained
        if source is None:
            return run_config, None
        last = latest_checkpoint(self.output_dir)
        return with_pretrained_config(run_config, last or source), None if last else source

    def _data_rank(self) -> dict[str, int]:
        # Tensor-parallel ranks of one data-parallel rank read the same data.
        return {"rank": self.distributed.data_rank, "ranks": self.distributed.data_size}

    def log(self, message: str) -> None:
        if self.distributed.rank == 0:
            self._log(message)

    # -- the loop ------------------------------------------------------------------------------------------------------

    def run(self) -> list[StepRecord]:
        """Train to `train_iters` (or, after SIGTERM / SIGINT, to the next step boundary, saving there)."""
        bar = Progress(total=self.config.train_iters, initial=self.step, enabled=self._shows_progress())
        with _StopSignals(self.log) as signals, bar as self._progress:
            self._trackers: Trackers | None = None  # started by `_run` on rank 0
            try:
                history = self._run(signals)
            except Stopped as stopped:
                last = latest_checkpoint(self.output_dir)
                kept = f"the last checkpoint ({last}) is intact" if last else "no checkpoint was written"
                name = signal.Signals(stopped.signal_number).name
                message = f"stopped at once by a second {name}; {kept}"
                self._finish_trackers("interrupted", message, failing=True, seconds=STOPPED_TRACKER_SECONDS)
                raise Stopped(stopped.signal_number, message) from None
            except TrackingError as error:  # a required tracker failed
                self._finish_trackers("failed", str(error), failing=True)
                raise TrainingError(str(error)) from None
            except BaseException as error:
                self._finish_trackers("failed", f"{type(error).__name__}: {error}", failing=True)
                raise
            self._finish_trackers("interrupted" if signals.received is not None else "finished")
            return history

    def _start_trackers(self) -> Trackers:
        """The run's trackers (`training.trackers`, rank 0), told the run's config, parameters and start step."""
        counts = {
            label: {"parameters": size, "layers": layers}
            for label, (size, layers) in parameter_counts(self.model).items()
        }
        counts["total"] = {"parameters": sum(count["parameters"] for count in counts.values()), "layers": 0}
        config, output_dir, step = to_dict(self.run_config), self.output_dir, self.step

        def run_for(name: str) -> TrackerRun:
            return TrackerRun(config=config, parameters=counts, output_dir=output_dir, start_step=step, name=name)

        configs = active_trackers(self.config.trackers)
        if list(configs) != ["jsonl"]:  # where the figures go, when it is not only metrics.jsonl
            registry = get_registry()
            named = [f"{name} ({registry.name_of(type(config))})" for name, config in configs.items()]
            self.log("trackers: " + ", ".join(named) + (" (required)" if self.config.trackers_required else ""))
        return Trackers(configs, run_for, required=self.config.trackers_required, report=self.log)

    def _finish_trackers(
        self, state: str, message: str | None = None, *, failing: bool = False, seconds: float | None = None
    ) -> None:
        """Tell the trackers how the run ended (waiting for them up to `seconds`, default `tracking.FINISH_SECONDS`).
        While the run fails already, a tracker's failure is only reported."""
        trackers, self._trackers = self._trackers, None
        if trackers is None:
            return
        try:
            trackers.finish(RunStatus(state=state, step=self.step, message=message), seconds)
        except TrackingError as error:
            if not failing:
                raise TrainingError(str(error)) from None
            self.log(str(error))

    def _run(self, signals: _StopSignals) -> list[StepRecord]:
        trained = self.step < self.config.train_iters
        self._log_start()
        if not trained:
            return self.history
        self._trackers = self._start_trackers() if self.distributed.rank == 0 else None
        started = time.perf_counter()
        batches = self.data.training_batches(**self._data_rank(), position=self.data_position)
        timer = Throughput(peak_flops(self.config.peak_tflops, self.distributed))
        self.model.train()  # and again after each evaluation
        self._upcoming = self._next_step_data(batches) if trained else None
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
            stop = self._stop_requested(signals)
            if (interval and self.step % interval == 0) or last or stop:
                self._read_figures()  # what a checkpoint keeps must be checked first
                directory = self.save()
            if stop and not last:
                self.log(
                    f"stopped at step {self.step} on a signal; checkpoint {directory} saved: the run resumes there"
                )
                return self.history
        if trained and self.config.export_format is not None:
            self.export()
        return self.history

    def _record(self, entry: dict[str, Any]) -> None:
        """A logged step's figures (training, evaluation or both): to the trackers (`metrics.jsonl`, ...), on rank 0."""
        if self._trackers is not None:
            self._trackers.log(entry["step"], entry)

    def _shows_progress(self) -> bool:
        """A progress bar on rank 0 when the log is the terminal's (the bar itself needs stderr to be one)."""
        return self.distributed.rank == 0 and self._log is _print

    def _log_start(self) -> None:
        """What the run will do: its parameters per kind of layer, its tokens per step, where it writes and where it
        starts (or that it has nothing to do)."""
        train_iters = self.config.train_iters
        self.log(parameters_line(self.model, pipeline_stages=self.run_config.distributed.pipeline_parallel))
        self.log(tokens_line(self.run_config, self.distributed.data_size))
        if self.step >= train_iters:
            self.log(
                f"nothing to do: the run in {self.output_dir} is complete ({self.resumed_from} is at step {self.step}, "
                f"training.train_iters is {train_iters}; raise it to train further)"
            )
        elif self.resumed_from is not None:
            self.log(
                f"output directory {self.output_dir}: resuming from {self.resumed_from} at step {self.step}, "
                f"training to step {train_iters}"
            )
        else:
            self.log(f"output directory {self.output_dir}: a new run of {train_iters} steps")

    def _build_evaluation_sets(self) -> dict[str, Dataset]:
        """What each evaluation reads, by the name its loss is logged under: `evaluation_loss` (the data's held-out
        split) and `evaluation_loss/<name>` (`training.evaluation.datasets`). A set that cannot be evaluated (missing,
        empty, too small for a micro-batch on every data rank) is refused before any step, naming it."""
        evaluation = self.config.evaluation
        if evaluation.interval is None:
            return {}
        run_data, seed = self.run_config.data, self.run_config.distributed.seed
        sets: dict[str, Dataset] = {}
        # The data's own split: when it holds one, or when it is all there is to evaluate (then its error is the one).
        if not evaluation.datasets or self.data.num_evaluation_samples != 0:
            sets["evaluation_loss"] = self.data
        for name, config in evaluation.datasets.items():
            where = f"training.evaluation.datasets.{name}"
            given = config.explicit_fields()
            shape = {key: getattr(run_data, key) for key in ("sequence_length", "micro_batch_size") if key not in given}
            try:
                sets[f"evaluation_loss/{name}"] = build_dataset(
                    attrs.evolve(config, **shape),
                    seed=seed,
                    model_vocab_size=self.run_config.model.embeddings.vocab_size,
                    log=self.log,
                    training=False,
                )
            except DatasetError as error:
                raise DatasetError(f"{where}: {error}") from None
        for key, dataset in sets.items():
            try:
                dataset.evaluation_batches(**self._data_rank())
            except DatasetError as error:
                if dataset is self.data:
                    raise DatasetError(
                        f"training.evaluation.interval is {evaluation.interval}, but {error}; or turn evaluation "
                        "off: training.evaluation.interval=null"
                    ) from None
                raise DatasetError(f"training.evaluation.datasets.{key.split('/', 1)[1]}: {error}") from None
        return sets

    def _harness_runner(self) -> HarnessRunner | None:
        """The benchmark of `training.evaluation.harness`, built (and its tasks checked) before any step."""
        config = self.config.evaluation.harness
        if config is None:
            return None
        tokenizer, stop = model_tokenizer(self.model, self.run_config, dataset=self.data, purpose="run benchmarks")
        return HarnessRunner(config, tokenizer, self.distributed, stop_tokens=stop)

    def _stop_requested(self, signals: _StopSignals) -> bool:
        """Whether any rank received a stop signal (every rank calls it at every step boundary)."""
        stop = signals.received is not None
        if self.distributed.world_size > 1:
            flag = torch.tensor([int(stop)], dtype=torch.int32, device=self.distributed.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = bool(flag.item())
        return stop

    def _prefetch(self, batches: TrainingBatches) -> None:
        self._upcoming = self._next_step_data(batches)

    def _flops(self, lengths: tuple[int, ...]) -> int:
        """Forward + backward FLOPs of a micro-batch of documents of `lengths`, by the layers' counts: remembered per
        lengths, since counting walks every layer on the host, inside a step that the host may bound (3.5 ms of a
        100M model's step on a slow CPU); whole rows and fixed lengths hit every time."""
        if lengths not in self._flops_by_lengths:
            if len(self._flops_by_lengths) >= 4096:  # documents of ever new lengths: keep it bounded
                self._flops_by_lengths.clear()
            forward, backward = self.model.flops(Batch(list(lengths)))
            self._flops_by_lengths[lengths] = forward + backward
        return self._flops_by_lengths[lengths]

    def _next_step_data(self, batches: TrainingBatches) -> StepData:
        """The next step's micro-batches of this rank, read and placed on the device (without waiting for it)."""
        micro_batches = [next(batches) for _ in range(self.config.gradient_accumulation)]
        flops = sum(self._flops(tuple(micro.lengths.tolist())) for micro in micro_batches)
        data_size = self.distributed.data_size
        return StepData(
            micro_batches=[
                place_micro_batch(micro, self.distributed, bucketed=self.config.cuda_graphs) for micro in micro_batches
            ],
            position=batches.position(),
            tokens=sum(len(micro.tokens) for micro in micro_batches) * data_size,
            flops=flops * data_size,
        )

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
        self.distributed.reduce_replicated_gradients(self._trainable)
        norm = self._clip_gradients()
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

    def forward_backward(self, micro_batches: list[PlacedMicroBatch]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The forward and backward passes of a step's micro-batches (of this rank): leaves the gradients of the
        step's loss, reduced over the data ranks, and returns on the device (no wait) the step's loss (the
        cross-entropy over the labelled tokens of all ranks) and its named losses (each averaged over the
        micro-batches of all ranks), the same on every rank.

        The objective of each micro-batch is its summed cross-entropy over the step's labelled-token count (all
        ranks), plus its named losses over the step's micro-batch count (all ranks): the gradients summed over the
        micro-batches and the data ranks are those of the step's loss, however the step is split.
        """
        device = self.distributed.device
        labelled = self._all_reduce_data(sum(micro.labelled() for micro in micro_batches)).clamp(min=1)
        micro_batches_of_all_ranks = len(micro_batches) * self.distributed.data_size
        if self.pipeline is not None:  # the schedule runs the micro-batches through this rank's stages
            step = self.pipeline.step(
                micro_batches, cross_entropy_divisor=labelled, named_loss_divisor=micro_batches_of_all_ranks
            )
            named = {name: value / micro_batches_of_all_ranks for name, value in step.named.items()}
            return self._reduce_loss(step.cross_entropy) / labelled, self._reduce_named(named)
        total_cross_entropy = torch.zeros((), device=device)
        named: dict[str, torch.Tensor] = {}
        for index, micro in enumerate(micro_batches):
            prepare_micro_batch(self.model, self.distributed, last=index + 1 == len(micro_batches))
            cross_entropy, losses = self.model.loss(micro.tokens, micro.labels, micro.batch)
            extra = sum(losses.values(), torch.zeros((), device=device)) / micro_batches_of_all_ranks
            (cross_entropy / labelled + extra).backward()
            total_cross_entropy += cross_entropy.detach().float()
            for name, value in losses.items():
                named[name] = named.get(name, 0.0) + value.detach().float() / micro_batches_of_all_ranks
        return self._reduce_loss(total_cross_entropy) / labelled, self._reduce_named(named)

    def _check_finite(self, what: str, value: float, step: int) -> None:
        if not math.isfinite(value):
            last = latest_checkpoint(self.output_dir)
            kept = f"the last checkpoint ({last}) is intact" if last else "no checkpoint was written"
            raise TrainingError(f"the {what} is {value} at step {step}; stopping, {kept}")

    # -- parallel reductions -------------------------------------------------------------------------------------------

    def _all_reduce_data(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the data and sequence-data ranks (each counts its own tokens)."""
        group = self.distributed.data_sequence_group
        if group is not None and self.distributed.data_sequence_size > 1:
            dist.all_reduce(tensor, group=group)
        return tensor

    def _reduce_loss(self, cross_entropy: torch.Tensor) -> torch.Tensor:
        """The cross-entropy summed over every labelled token of the step, on every rank (on the device)."""
        if self.distributed.sequence_tensor_parallel:
            dist.all_reduce(cross_entropy, group=self.distributed.tensor_group)
        return self._all_reduce_data(cross_entropy)

    def _reduce_named(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each named loss summed over the data ranks (every tensor rank computes the same: routing sees all tokens;
        so does every sequence-data rank: `slice_losses` covers the whole micro-batch)."""
        group = self.distributed.data_group
        if not named or group is None or self.distributed.data_size == 1:
            return named
        values = torch.stack(list(named.values()))
        dist.all_reduce(values, group=group)
        return dict(zip(named, values.unbind()))

    def _gradient_norm_groups(self) -> list[tuple[int, int, list[nn.Parameter]]]:
        """The trainable parameters by how the squares of their gradients are summed (see `_clip_gradients`):
        (tensor-parallel split, 0 replicated / 1 experts split over data / 2 FSDP shards, parameters of one dtype),
        a pipeline stage's copy of a tied weight left out (the first stage counts it)."""
        copies = set() if self.pipeline is None else self.pipeline.copies
        groups: dict[tuple[int, int, torch.dtype], list[nn.Parameter]] = {}
        for name, parameter in self.model.named_parameters():
            if not parameter.requires_grad or name in copies:
                continue
            meta = parameter.meta
            split = 1 if meta.data_parallel_sharded else 2 if is_sharded(parameter) else 0
            groups.setdefault((int(meta.tensor_parallel), split, parameter.dtype), []).append(parameter)
        return [(parallel, split, parameters) for (parallel, split, _), parameters in groups.items()]

    def _clip_gradients(self) -> torch.Tensor:
        """The global gradient norm (on the device), the gradients clipped to the config's limit. Squares of
        gradients split over the tensor group are summed over it; of experts (split over the data group under expert
        parallelism), over the data group; of FSDP shards (ZeRO 1-3), over the data and sequence-data ranks FSDP
        shards over; all over the pipeline stages, each counting its own parameters (a tied weight's copy on the
        last stage is the first stage's)."""
        distributed = self.distributed
        # squares[tensor-parallel split][replicated, experts (split over data), FSDP shards (over data × sequence)]
        squares = torch.zeros(2, 3, device=distributed.device)
        # One multi-tensor norm per group: a few kernels in all, not several per parameter (a step of a small model
        # is bound by the host's kernel launches).
        for parallel, split, parameters in self._norm_groups:
            grads = [local_tensor(parameter.grad) for parameter in parameters if parameter.grad is not None]
            if grads:
                squares[parallel, split] += torch.stack(torch._foreach_norm(grads, 2)).float().pow(2).sum()
        if distributed.tensor_group is not None and distributed.tensor_size > 1:
            dist.all_reduce(squares[1], group=distributed.tensor_group)
        for split, group, size in (
            (1, distributed.data_group, distributed.data_size),
            (2, distributed.data_sequence_group, distributed.data_sequence_size),
        ):
            if group is not None and size > 1:
                data_split = squares[:, split].contiguous()
                dist.all_reduce(data_split, group=group)
                squares[:, split] = data_split
        if self.pipeline is not None:
            dist.all_reduce(squares, group=self.distributed.pipeline_group)
        norm = squares.sum().sqrt()
        limit = self.config.gradient_clipping
        grads = [] if limit is None else [local_tensor(p.grad) for p in self._trainable if p.grad is not None]
        if grads:
            # As torch.nn.utils.clip_grad_norm_: a factor of at most 1, computed and applied on the device.
            torch._foreach_mul_(grads, (limit / (norm + 1e-6)).clamp(max=1.0))
        return norm

    # -- evaluation, checkpoints ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def _evaluate(self) -> dict[str, float]:
        """The evaluation figures of this step, as the metrics file names them: the loss of each evaluation set
        (`_build_evaluation_sets`) over its first `training.evaluation.iters` micro-batches (or all it holds)."""
        self.model.eval()
        losses = [self._evaluation_loss(dataset) for dataset in self._evaluation_sets.values()]
        figures = dict(zip(self._evaluation_sets, to_host(losses)))
        for module in [self.model] if self.pipeline is None else self.pipeline.modules:
            reshard(module)  # the forward passes without a backward left weights gathered
        self.model.train()
        if "evaluation_loss" in figures:
            self.evaluations.append((self.step, figures["evaluation_loss"]))
        described = ", ".join(f"{name.removeprefix('evaluation_')} {loss:.4f}" for name, loss in figures.items())
        self.log(f"evaluation at step {self.step}: {described}")
        return figures

    def _evaluation_loss(self, dataset: Dataset) -> torch.Tensor:
        """The mean cross-entropy of a set's first micro-batches over every data rank (on the device)."""
        device = self.distributed.device
        total, count = torch.zeros((), device=device), torch.zeros((), device=device)
        batches = dataset.evaluation_batches(**self._data_rank())
        evaluated = itertools.islice(batches, self.config.evaluation.iters)
        placed = [place_micro_batch(micro, self.distributed) for micro in evaluated]
        if self.pipeline is not None:  # through the stages, forward only
            total = self.pipeline.evaluate(placed)
        else:
            for micro in placed:
                cross_entropy, _ = self.model.loss(micro.tokens, micro.labels, micro.batch)
                total += cross_entropy.float()
        count = sum((micro.labelled() for micro in placed), count)
        return self._reduce_loss(total) / self._all_reduce_data(count).clamp(min=1)

    def save(self) -> Path:
        """Save `step_<N>` (every rank), then prune to `checkpoint_keep`. A weight (or optimizer state) that is not
        finite stops the run (`TrainingError`) with nothing written."""
        directory = self.output_dir / f"step_{self.step}"
        try:
            save_checkpoint(
                directory,
                model=self.model,
                optimizer=self.optimizer,
                run_config=self.run_config,
                step=self.step,
                distributed=self.distributed,
                data_state=self.data_position,
                extra={"random_states": random_states(self.model, self.distributed)},
                origin=self.model.origin,
                keep=self.config.checkpoint_keep,
                log=self.log,
                base=self.base,
            )
        except NonFiniteError as error:
            last = latest_checkpoint(self.output_dir)
            kept = f"the last checkpoint ({last}) is intact" if last else "no checkpoint was written"
            raise TrainingError(f"after step {self.step}, {error}; stopping, {kept}") from None
        if self.model.origin is not None:  # the newest copies: the checkpoints holding older ones may be pruned
            self.model.origin = attrs.evolve(self.model.origin, directory=directory / ORIGIN_DIRECTORY)
        if self.distributed.rank == 0:
            keep_last(self.output_dir, self.config.checkpoint_keep)
        self.log(f"saved checkpoint {directory}")
        return directory

    def export(self) -> Path:
        """Convert the latest checkpoint to `training.export_format` (rank 0 writes; the others wait for it)."""
        export_format = self.config.export_format
        destination = Path(self.config.export_dir or self.output_dir / export_format)
        failure: BaseException | None = None
        if self.distributed.rank == 0:
            try:
                convert(latest_checkpoint(self.output_dir), destination, format=export_format)
            except BaseException as error:  # noqa: BLE001 - the other ranks must hear of it before it is raised
                failure = error
        if self.distributed.world_size > 1:
            failed = torch.tensor([failure is not None], dtype=torch.int32, device=self.distributed.device)
            dist.broadcast(failed, src=0)
            if failed.item() and failure is None:
                raise TrainingError(f"rank 0 failed to export to {destination} (its error is in its log)")
        if failure is not None:
            raise failure
        self.log(f"exported {destination} ({export_format})")
        return destination

    def _resume(self, last: Path | None) -> None:
        if last is None:
            return
        _, metadata = load_checkpoint(
            last,
            model=self.model,
            optimizer=self.optimizer,
            distributed=self.distributed,
            model_source="the model of the run config",
            base_loaded=bool(self._resumed_base),
        )
        self.step = int(metadata["step"])
        self.data_position = metadata.get("data")
        try:  # a bad position is the metadata's fault
            self.data.training_batches(**self._data_rank(), position=self.data_position)
        except DatasetError as error:
            raise CheckpointError(last / METADATA_FILE, f"`data`: {error}") from None
        self.model.origin = read_origin(last)
        extra = metadata.get("extra") or {}
        problem = restore_random_states(self.model, self.distributed, extra.get("random_states"))
        if problem is not None:
            self.log(f"random states not restored ({problem}): random draws differ from a run that did not stop")
        self.log(f"resumed from {last} (step {self.step})")


def _print(message: str) -> None:
    write_line(message)  # above the progress bar, if there is one
