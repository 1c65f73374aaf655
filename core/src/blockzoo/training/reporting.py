"""What the trainer reports: the log line of a step (throughput, MFU) and the memory each rank holds at the start."""

from __future__ import annotations

import time

import attrs
import torch
import torch.distributed as dist
from torch import nn

from blockzoo.distributed.data_parallel import is_sharded
from blockzoo.distributed.ops import all_gather_tensors
from blockzoo.distributed.runtime import Distributed, local_tensor

# Dense bf16 peaks (TFLOP/s) of the GPUs whose MFU we report without being told.
KNOWN_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


@attrs.frozen
class MemoryUsage:
    """Bytes this rank holds for the training state: `parameters` (its stored shards), `gradients` (what a step
    accumulates: whole tensor-parallel shards under ZeRO 0-1, data-parallel shards from ZeRO 2 on) and `optimizer`
    (its state, e.g. AdamW's two moments of every trained shard). Not counted: weights FSDP gathers for the duration
    of a forward or backward pass (all of them during a step under ZeRO 1-2, one or two blocks at a time under 3)."""

    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer


def memory_usage(model: nn.Module, optimizer: torch.optim.Optimizer, zero_stage: int) -> MemoryUsage:
    """This rank's `MemoryUsage` (the optimizer's state as it will be once allocated: `state_bytes()`)."""
    parameters = gradients = 0
    for parameter in model.parameters():  # each once, tied ones too
        stored = local_tensor(parameter.detach())
        parameters += stored.numel() * stored.element_size()
        if parameter.requires_grad:
            accumulated = stored.numel() if zero_stage >= 2 or not is_sharded(parameter) else parameter.numel()
            gradients += accumulated * stored.element_size()
    state = optimizer.state_bytes() if hasattr(optimizer, "state_bytes") else 0
    return MemoryUsage(parameters=parameters, gradients=gradients, optimizer=state)


def memory_report(usage: MemoryUsage, distributed: Distributed) -> str:
    """The largest `MemoryUsage` of any rank (per pipeline stage when there are several), as a log line. Every rank
    calls it (a collective)."""
    figures = torch.tensor([usage.parameters, usage.gradients, usage.optimizer], dtype=torch.float64)
    if distributed.world_size > 1:
        figures = torch.stack(all_gather_tensors(figures.to(distributed.device), dist.group.WORLD)).cpu()
    per_rank = figures.reshape(-1, 3)
    stages = distributed.config.pipeline_parallel
    layout = f"ZeRO stage {distributed.config.zero_stage} over {distributed.data_size} data-parallel ranks"
    if distributed.sequence_data_size > 1:
        layout += f" × {distributed.sequence_data_size} sequence-data-parallel ranks"
    parts = []
    for stage, ranks in enumerate(per_rank.chunk(stages)):  # ranks are laid out pipeline-major
        top = ranks.max(0).values.tolist()
        where = f"stage {stage}: " if stages > 1 else ""
        parts.append(
            f"{where}parameters {_bytes(top[0])}, gradients {_bytes(top[1])}, optimizer state {_bytes(top[2])}, "
            f"total {_bytes(sum(top))}"
        )
    gathered = {1: "all of them", 2: "all of them", 3: "a block at a time"}.get(distributed.config.zero_stage)
    if gathered and distributed.data_sequence_size > 1:
        parts.append(f"plus the weights gathered during a step ({gathered})")
    return f"memory per rank (the most of any rank; {layout}): " + "; ".join(parts)


def _bytes(count: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.3g} {unit}"
    return f"{count:.0f} B"


def peak_flops(config_peak_tflops: float | None, distributed: Distributed) -> float | None:
    """The peak FLOP/s of all ranks together: the configured per-device peak, or a known GPU's, else None."""
    if config_peak_tflops is not None:
        return config_peak_tflops * 1e12 * distributed.world_size
    if distributed.device.type == "cuda":
        name = torch.cuda.get_device_name(distributed.device)
        for model, peak in KNOWN_PEAK_TFLOPS.items():
            if model in name:
                return peak * 1e12 * distributed.world_size
    return None


class Throughput:
    """Tokens and model FLOPs since the last `reset`, over the wall-clock time since then."""

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


def step_line(record, train_iters: int, timer: Throughput) -> str:
    """The log line of a step (`record`: a `StepRecord`)."""
    parts = [
        f"step {record.step}/{train_iters}",
        f"loss {record.loss:.4f}",
        *(f"{name} {value:.4g}" for name, value in record.losses.items()),
        f"lr {record.learning_rate:.3g}",
        f"grad norm {record.gradient_norm:.3g}",
        f"{timer.tokens_per_second:,.0f} tokens/s",
        f"{timer.tflops:.3g} TFLOP/s",
    ]
    if timer.mfu is not None:
        parts.append(f"MFU {timer.mfu:.1%}")
    return f"{progress_bar(record.step, train_iters)} " + " | ".join(parts)


def progress_bar(step: int, total: int, width: int = 20) -> str:
    filled = round(width * step / total)
    return f"[{'#' * filled}{'.' * (width - filled)}]"
