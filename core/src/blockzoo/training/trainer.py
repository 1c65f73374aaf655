"""The training loop: `blockzoo train CONFIG` (one process, or every rank under `torchrun`).

One optimizer step takes `gradient_accumulation` micro-batches on each data-parallel rank. The loss
is the cross-entropy summed over every labelled token of the step (all micro-batches, all ranks)
divided by their count, plus the layers' named losses averaged over the micro-batches of all ranks,
so the gradients do not depend on how the step is split. Each rank's backward pass covers its share
of that sum: gradients of replicated parameters that saw token shards (sequence-tensor-parallel) are
summed over the tensor group, then all gradients are summed over the data-parallel ranks.
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist

from blockzoo.checkpoint import (
    ORIGIN_DIRECTORY,
    keep_last,
    latest_checkpoint,
    load_checkpoint,
    read_origin,
    save_checkpoint,
)
from blockzoo.conversion import get_format
from blockzoo.data.dataset import build_dataset
from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.base import IGNORE_INDEX, Batch
from blockzoo.layers.parameter import uninitialized
from blockzoo.model.factory import convert, load_pretrained_weights, pretrained_origin, with_pretrained_config
from blockzoo.model.language_model import LanguageModel
from blockzoo.plugins import get_registry
from blockzoo.run_config import RunConfig
from blockzoo.training.optimizer import learning_rate, unique_trainable

# Dense bf16 peaks (TFLOP/s) of the GPUs whose MFU we report without being told.
KNOWN_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


class TrainingError(RuntimeError):
    """The run cannot go on (a non-finite loss, ...); the last checkpoint is intact."""


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
        self.distributed = distributed or Distributed(run_config.distributed)
        self._log = log or _print
        if self.config.export_format is not None:  # refuse a model the format cannot hold before training it
            get_format(self.config.export_format).check_model_config(run_config.model)
        torch.manual_seed(run_config.distributed.seed)
        last = latest_checkpoint(self.output_dir)
        with uninitialized(pretrained is not None or last is not None):  # the checkpoint has every weight
            self.model = LanguageModel(run_config.model, self.distributed)
        if pretrained is not None:
            load_pretrained_weights(self.model, pretrained, self.distributed)
            self.model.origin = pretrained_origin(pretrained)
            self.log(f"initialized from {pretrained}")
        optimizer_class = get_registry().implementation_of(self.config.optimizer)
        self.optimizer = optimizer_class(self.config.optimizer, self.model.parameters())
        self.data = build_dataset(
            run_config.data, seed=run_config.distributed.seed, model_vocab_size=run_config.model.embeddings.vocab_size
        )
        self.step = 0
        self.data_position: Any = None
        self.history: list[StepRecord] = []
        self.evaluations: list[tuple[int, float]] = []
        self._resume(last)

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
        trained = self.step < self.config.train_iters
        batches = self.data.training_batches(**self._data_rank(), position=self.data_position)
        timer = _Throughput(self._peak_flops())
        while self.step < self.config.train_iters:
            micro_batches = [next(batches) for _ in range(self.config.gradient_accumulation)]
            record = self._train_step(micro_batches)
            self.step += 1
            self.data_position = batches.position()
            self.history.append(record)
            timer.add(
                sum(len(micro.tokens) for micro in micro_batches) * self.distributed.data_size,
                self._flops(micro_batches),
            )
            if self.step % self.config.log_interval == 0 or self.step == self.config.train_iters:
                self.log(self._format(record, timer))
                timer.reset()
            evaluation = self.config.evaluation
            if evaluation.interval and (self.step % evaluation.interval == 0 or self.step == self.config.train_iters):
                self._evaluate()
            interval = self.config.checkpoint_interval
            if (interval and self.step % interval == 0) or self.step == self.config.train_iters:
                self.save()
        if trained and self.config.export_format is not None:
            self.export()
        return self.history

    def _train_step(self, micro_batches: list) -> StepRecord:
        self.model.train()
        rate = learning_rate(
            self.step,
            peak=self.config.optimizer.learning_rate,
            train_iters=self.config.train_iters,
            schedule=self.config.schedule,
        )
        self.optimizer.set_learning_rate(rate)
        self.optimizer.zero_grad(set_to_none=True)
        device = self.distributed.device
        labelled = sum(int((micro.labels != IGNORE_INDEX).sum()) for micro in micro_batches)
        labelled = self._all_reduce_data(torch.tensor(float(labelled), device=device)).clamp(min=1)
        # The gradients are summed over the data-parallel ranks: each rank's named losses weigh 1 / all micro-batches.
        micro_batches_of_all_ranks = len(micro_batches) * self.distributed.data_size
        total_cross_entropy = torch.zeros((), device=device)
        named: dict[str, float] = {}
        for micro in micro_batches:
            tokens, labels = micro.tokens.to(device), micro.labels.to(device)
            cross_entropy, losses = self.model.loss(tokens, labels, Batch(micro.lengths, device=device))
            extra = sum(losses.values(), torch.zeros((), device=device)) / micro_batches_of_all_ranks
            (cross_entropy / labelled + extra).backward()
            total_cross_entropy += cross_entropy.detach().float()
            for name, value in losses.items():
                named[name] = named.get(name, 0.0) + float(value.detach()) / len(micro_batches)
        loss = self._reduce_loss(total_cross_entropy) / float(labelled)
        self._check_finite("loss", loss)
        self._reduce_gradients()
        norm = self._clip_gradients()
        self._check_finite("gradient norm", norm)  # before the update, so the weights stay finite
        self.optimizer.step()
        return StepRecord(step=self.step + 1, loss=loss, learning_rate=rate, gradient_norm=norm, losses=named)

    def _check_finite(self, what: str, value: float) -> None:
        if not math.isfinite(value):
            last = latest_checkpoint(self.output_dir)
            kept = f"the last checkpoint ({last}) is intact" if last else "no checkpoint was written"
            raise TrainingError(f"the {what} is {value} at step {self.step + 1}; stopping, {kept}")

    # -- parallel reductions -------------------------------------------------------------------------------------------

    def _all_reduce_data(self, tensor: torch.Tensor) -> torch.Tensor:
        group = self.distributed.data_group
        if group is not None:
            dist.all_reduce(tensor, group=group)
        return tensor

    def _reduce_loss(self, cross_entropy: torch.Tensor) -> float:
        """The cross-entropy summed over every labelled token of the step, on every rank."""
        if self.distributed.sequence_tensor_parallel:
            dist.all_reduce(cross_entropy, group=self.distributed.tensor_group)
        return float(self._all_reduce_data(cross_entropy))

    def _reduce_gradients(self) -> None:
        parameters = unique_trainable(self.model.parameters())
        self.distributed.reduce_replicated_gradients(parameters)
        group = self.distributed.data_group
        if group is not None:
            for parameter in parameters:
                # A data-parallel sharded parameter (an expert) already has the gradient of every rank's tokens:
                # expert parallelism's all-to-all brought them to the rank that holds it.
                if parameter.grad is not None and not parameter.meta.data_parallel_sharded:
                    dist.all_reduce(parameter.grad, group=group)

    def _clip_gradients(self) -> float:
        """The global gradient norm, clipped to the config's limit. Squares of parameters split over the tensor
        group are summed over it, those of parameters split over the data group (experts) over the data group."""
        # squares[tensor-parallel split][data-parallel split]
        squares = torch.zeros(2, 2, device=self.distributed.device)
        parameters = [p for p in unique_trainable(self.model.parameters()) if p.grad is not None]
        for parameter in parameters:
            meta = parameter.meta
            squares[int(meta.tensor_parallel), int(meta.data_parallel_sharded)] += parameter.grad.float().pow(2).sum()
        if self.distributed.tensor_group is not None:
            dist.all_reduce(squares[1], group=self.distributed.tensor_group)
        if self.distributed.data_group is not None:
            data_sharded = squares[:, 1].contiguous()
            dist.all_reduce(data_sharded, group=self.distributed.data_group)
            squares[:, 1] = data_sharded
        norm = float(squares.sum().sqrt())
        limit = self.config.gradient_clipping
        if limit is not None and norm > limit:
            for parameter in parameters:
                parameter.grad.mul_(limit / (norm + 1e-6))
        return norm

    # -- evaluation, checkpoints ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def _evaluate(self) -> float:
        self.model.eval()
        device = self.distributed.device
        total, count = torch.zeros((), device=device), torch.zeros((), device=device)
        batches = self.data.evaluation_batches(**self._data_rank())
        for micro in itertools.islice(batches, self.config.evaluation.iters):
            tokens, labels = micro.tokens.to(device), micro.labels.to(device)
            cross_entropy, _ = self.model.loss(tokens, labels, Batch(micro.lengths, device=device))
            total += cross_entropy.float()
            count += float((micro.labels != IGNORE_INDEX).sum())
        loss = self._reduce_loss(total) / float(self._all_reduce_data(count).clamp(min=1))
        self.evaluations.append((self.step, loss))
        self.log(f"evaluation at step {self.step}: loss {loss:.4f}")
        return loss

    def save(self) -> Path:
        directory = self.output_dir / f"step_{self.step}"
        save_checkpoint(
            directory,
            model=self.model,
            optimizer=self.optimizer,
            run_config=self.run_config,
            step=self.step,
            distributed=self.distributed,
            data_state=self.data_position,
            origin=self.model.origin,
        )
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
        _, metadata = load_checkpoint(last, model=self.model, optimizer=self.optimizer, distributed=self.distributed)
        self.step = int(metadata["step"])
        self.data_position = metadata.get("data")
        self.model.origin = read_origin(last)
        self.log(f"resumed from {last} (step {self.step})")

    # -- reporting -----------------------------------------------------------------------------------------------------

    def _flops(self, micro_batches: list) -> int:
        """Model FLOPs of the step on all data-parallel ranks (forward + backward)."""
        total = 0
        for micro in micro_batches:
            forward, backward = self.model.flops(Batch(micro.lengths))
            total += forward + backward
        return total * self.distributed.data_size

    def _peak_flops(self) -> float | None:
        if self.config.peak_tflops is not None:
            return self.config.peak_tflops * 1e12 * self.distributed.world_size
        if self.distributed.device.type == "cuda":
            name = torch.cuda.get_device_name(self.distributed.device)
            for model, peak in KNOWN_PEAK_TFLOPS.items():
                if model in name:
                    return peak * 1e12 * self.distributed.world_size
        return None

    def _format(self, record: StepRecord, timer: _Throughput) -> str:
        parts = [
            f"step {record.step}/{self.config.train_iters}",
            f"loss {record.loss:.4f}",
            *(f"{name} {value:.4g}" for name, value in record.losses.items()),
            f"lr {record.learning_rate:.3g}",
            f"grad norm {record.gradient_norm:.3g}",
            f"{timer.tokens_per_second:,.0f} tokens/s",
            f"{timer.tflops:.3g} TFLOP/s",
        ]
        if timer.mfu is not None:
            parts.append(f"MFU {timer.mfu:.1%}")
        bar = _progress_bar(record.step, self.config.train_iters)
        return f"{bar} " + " | ".join(parts)


class _Throughput:
    def __init__(self, peak_flops: float | None):
        self.peak_flops = peak_flops
        self.reset()

    def reset(self) -> None:
        self.start, self.tokens, self.flops = time.perf_counter(), 0, 0

    def add(self, tokens: int, flops: int) -> None:
        self.tokens += tokens
        self.flops += flops

    @property
    def seconds(self) -> float:
        return max(time.perf_counter() - self.start, 1e-9)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    @property
    def tflops(self) -> float:
        return self.flops / self.seconds / 1e12

    @property
    def mfu(self) -> float | None:
        return None if self.peak_flops is None else self.flops / self.seconds / self.peak_flops


def _progress_bar(step: int, total: int, width: int = 20) -> str:
    filled = round(width * step / total)
    return f"[{'#' * filled}{'.' * (width - filled)}]"


def _print(message: str) -> None:
    print(message, file=sys.stdout, flush=True)
