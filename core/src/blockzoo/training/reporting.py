"""What the trainer reports: what a run will do (parameters per kind of layer), the memory each rank holds at the
start, the log line of a step (throughput, MFU) and its metrics file entry."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn

from blockzoo.distributed.data_parallel import is_sharded
from blockzoo.distributed.ops import all_gather_tensors
from blockzoo.distributed.runtime import Distributed, local_tensor
from blockzoo.plugins import get_registry

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
    """Tokens and model FLOPs since the last `reset`, over the wall-clock time since then: up to `stop`, so that every
    figure of one log line (tokens/s, TFLOP/s, MFU) divides by the same time."""

    def __init__(self, peak_flops: float | None):
        self.peak_flops = peak_flops
        self.reset()

    def reset(self) -> None:
        self.start, self.end, self.tokens, self.flops = time.perf_counter(), None, 0, 0

    def add(self, tokens: int, flops: int) -> None:
        self.tokens += tokens
        self.flops += flops

    def stop(self) -> None:
        self.end = time.perf_counter()

    @property
    def seconds(self) -> float:
        end = self.end if self.end is not None else time.perf_counter()
        return max(end - self.start, 1e-9)

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
    """The log line of a step (`record`: a `StepRecord`). Named losses of the same kind (each MoE layer's
    `load_balancing`, ...) are summed on the line, each kind once; the metrics file has every one."""
    parts = [
        f"step {record.step}/{train_iters}",
        f"loss {record.loss:.4f}",
        *(f"{kind} {value:.4g}" for kind, value in summed_losses(record.losses).items()),
        f"lr {record.learning_rate:.3g}",
        f"grad norm {record.gradient_norm:.3g}",
        f"{timer.tokens_per_second:,.0f} tokens/s",
        f"{timer.tflops:.3g} TFLOP/s",
    ]
    if timer.mfu is not None:
        parts.append(f"MFU {timer.mfu:.1%}")
    return " | ".join(parts)


def summed_losses(losses: dict[str, float]) -> dict[str, float]:
    """Named losses summed per kind, the kind being the name's last part (`decoder.3.mlp.load_balancing`:
    `load_balancing`); a kind of several layers is labelled with their count (`load_balancing (4 layers)`)."""
    sums: dict[str, list[float]] = {}
    for name, value in losses.items():
        sums.setdefault(name.rpartition(".")[2], []).append(value)
    return {
        kind if len(values) == 1 else f"{kind} ({len(values)} layers)": sum(values) for kind, values in sums.items()
    }


def metrics_entry(record, tokens: int, seconds: float, timer: Throughput) -> dict[str, Any]:
    """The metrics file's entry of a logged step (see `blockzoo.training.metrics`)."""
    entry = {
        "step": record.step,
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "loss": record.loss,
        "learning_rate": record.learning_rate,
        "gradient_norm": record.gradient_norm,
        "tokens_per_second": timer.tokens_per_second,
        "tflops": timer.tflops,
    }
    if timer.mfu is not None:
        entry["mfu"] = timer.mfu
    return entry | record.losses


# ---------------------------------------------------------------------------------------------------------------------
# What a run says when it starts


def tokens_line(run_config, data_size: int) -> str:
    """Tokens of one optimizer step over all data-parallel ranks (sequence-data ranks share their data rank's)."""
    data, accumulation = run_config.data, run_config.training.gradient_accumulation
    total = data.sequence_length * data.micro_batch_size * accumulation * data_size
    return (
        f"tokens per step: {total:,} ({_many(data.micro_batch_size, 'sequence')} of {data.sequence_length} tokens × "
        f"{_many(accumulation, 'micro-batch')} × {_many(data_size, 'data-parallel rank')})"
    )


def _many(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "es" if noun.endswith("h") else "s")


def parameter_counts(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Parameters per kind of layer: `mixer attention`, `mlp moe`, `normalization rms_norm`, ... (the registered
    types of the model's parts; a part holding other registered parts counts them), `embeddings`, `head`; each as
    (parameters, layers). Whole tensors (not this rank's tensor- or data-parallel shards); tied ones once."""
    registry = get_registry(strict=False)
    implementations = {
        entry.implementation: entry
        for entry in registry.entries()
        if entry.implementation and entry.kind not in ("block", "block_sequence")  # containers: their parts count
    }
    layers: list[tuple[str, str]] = []  # (path prefix, kind label), outermost registered parts only
    for path, module in model.named_modules():
        if any(path.startswith(prefix) for prefix, _ in layers):
            continue
        for cls in type(module).__mro__:
            if (entry := implementations.get(f"{cls.__module__}:{cls.__qualname__}")) is not None:
                layers.append((path + ".", f"{entry.kind} {entry.name}"))
                break
    counts: dict[str, list] = {}
    for name, parameter in model.named_parameters():
        meta = getattr(parameter, "meta", None)
        size = math.prod(meta.global_shape) if meta is not None else parameter.numel()
        label = next((kind for prefix, kind in layers if name.startswith(prefix)), None)
        prefix = next((prefix for prefix, kind in layers if name.startswith(prefix)), None)
        label = label or name.split(".")[0].replace("_orig_mod", "")
        count = counts.setdefault(label, [0, set()])
        count[0] += size
        count[1].add(prefix or label)
    return {label: (size, len(paths)) for label, (size, paths) in counts.items()}


def parameters_line(model: nn.Module, *, pipeline_stages: int) -> str:
    """`parameters: 1.2M — mixer attention 801K in 4 layers, ...`."""
    counts = parameter_counts(model)
    total = sum(size for size, _ in counts.values())
    parts = [
        f"{label} {_count(size)}" + (f" in {layers} layers" if layers > 1 else "")
        for label, (size, layers) in counts.items()
    ]
    where = " (this rank's pipeline stages)" if pipeline_stages > 1 else ""
    return f"parameters{where}: {_count(total)} — " + ", ".join(parts)


def _count(number: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if number >= size:
            return f"{number / size:.3g}{unit}"
    return str(number)


def start_lines(model: nn.Module, run_config, data_size: int, *, step: int, resumed_from) -> list[str]:
    """What a run will do: its parameters per kind of layer, its tokens per step, where it writes and where it
    starts (or that it has nothing to do)."""
    output_dir, train_iters = Path(run_config.training.output_dir), run_config.training.train_iters
    lines = [
        parameters_line(model, pipeline_stages=run_config.distributed.pipeline_parallel),
        tokens_line(run_config, data_size),
    ]
    if step >= train_iters:
        lines.append(
            f"nothing to do: the run in {output_dir} is complete ({resumed_from} is at step {step}, "
            f"training.train_iters is {train_iters}; raise it to train further)"
        )
    elif resumed_from is not None:
        lines.append(f"output directory {output_dir}: resuming from {resumed_from} at step {step}, training to step ")
        lines[-1] += str(train_iters)
    else:
        lines.append(f"output directory {output_dir}: a new run of {train_iters} steps")
    return lines
