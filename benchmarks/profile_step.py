"""Where a training step's time goes: the Trainer and the bare step of an example config under torch.profiler.

    python benchmarks/profile_step.py [examples/gpu_hybrid.yaml] [--steps 6] [--warmup 4] [--top 15]
        [--trace DIR] [KEY=VALUE ...]
    python benchmarks/profile_step.py --llama 4x4096 [KEY=VALUE ...]   (llama.py's Llama-1B, bare step)

For each of the two (the Trainer with a log line per step; the bare step of benchmarks/ours.py), after `--warmup`
steps it profiles `--steps` steps (the bare step: one document per row; the Trainer: the config's data, or whole rows
with `--one-document-per-row`) and prints: wall time per step, the GPU's busy time per step (the union of its
kernels' intervals), so whether the step waits on the host, and the operators and kernels that take the most time.
`--trace DIR` also writes Chrome traces (open in Perfetto). It answers questions the timing suites cannot, such as
why the Trainer's eager hybrid step takes longer than the bare one.

`--phases` instead runs the Trainer without the profiler (whose own cost distorts a step the host bounds) and prints
the host's time per step in each part of it (the forward and backward passes, the gradient norm, the optimizer's
launches, the next step's data, the read of the figures, the rest of the loop), with `--log-interval` steps per log
line, and the bare step's time beside it. The profiled steps need a CUDA GPU; `--phases` also runs on the CPU (a
config that does not graph its steps: `training.cuda_graphs=false`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/profile_step.py`: see llama.py
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import harness, ours, shapes
from benchmarks.trainer import STEP_LINE


def gpu_work(events) -> list:
    """The GPU's kernels, copies and fills among the profiler's events: neither the annotations it records on the
    GPU's timeline (the optimizer's step, compiled regions), which span kernels, nor CUPTI's own overhead."""
    work = []
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CUDA or getattr(event, "is_user_annotation", False):
            continue
        activity = str(getattr(event, "activity_type", None) or "kernel").lower()
        if any(kind in activity for kind in ("kernel", "memcpy", "memset")):
            work.append(event)
    return work


def busy_seconds(events) -> float:
    """The union of the GPU kernels' intervals (overlapping streams counted once)."""
    intervals = sorted((event.time_range.start, event.time_range.end) for event in gpu_work(events))
    busy, current_start, current_end = 0.0, None, None
    for start, end in intervals:
        if current_end is None or start > current_end:
            if current_end is not None:
                busy += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        busy += current_end - current_start
    return busy / 1e6  # microseconds


NAME_WIDTH = 110  # inductor's kernel names list the operations they fuse: wide enough to tell them apart

# Kernel names → what they compute, for the per-step summary. The first match wins, so Triton first: inductor's
# names carry the operations they fuse ("triton_poi_fused__scaled_mm_..." casts for an FP8 product).
KERNEL_KINDS = [
    ("Triton (inductor's and ours)", ("triton",)),
    ("matrix products", ("gemm", "nvjet", "cutlass", "xmma")),
    ("attention", ("cudnn", "flash", "fmha", "attention")),
    ("optimizer", ("adam", "multi_tensor")),
]


def kernel_kinds(events) -> dict[str, float]:
    """GPU time in seconds by KERNEL_KINDS (the rest as "other")."""
    totals: dict[str, float] = {}
    for event in gpu_work(events):
        name = event.name.lower()
        kind = next((kind for kind, marks in KERNEL_KINDS if any(mark in name for mark in marks)), "other")
        totals[kind] = totals.get(kind, 0.0) + (event.time_range.end - event.time_range.start) / 1e6
    return totals


def report(name: str, profiler, steps: int, wall_s: float, top: int, trace: Path | None) -> None:
    events = profiler.events()
    print(f"\n## {name}: {wall_s / steps * 1e3:.1f} ms per step, GPU busy {busy_seconds(events) / steps * 1e3:.1f} ms")
    kinds = sorted(kernel_kinds(events).items(), key=lambda item: -item[1])
    print("   GPU time per step: " + ", ".join(f"{kind} {seconds / steps * 1e3:.2f} ms" for kind, seconds in kinds))
    averages = profiler.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=NAME_WIDTH))
    print(averages.table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=NAME_WIDTH))
    if trace is not None:
        trace.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(trace / f"{name.replace(' ', '_')}.json"))


def profile_bare(config, arguments) -> None:
    model, optimizer = ours.build(config)
    tokens = ours.random_tokens(
        config.data.micro_batch_size, config.data.sequence_length, config.model.embeddings.vocab_size, "cuda"
    )
    step = ours.bare_step(model, optimizer, tokens, cuda_graphs=ours.uses_cuda_graphs(config))
    for _ in range(arguments.warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        start = time.perf_counter()
        for _ in range(arguments.steps):
            step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    report("bare step", profiler, arguments.steps, wall, arguments.top, arguments.trace)


def profile_trainer(config_path, overrides, arguments) -> None:
    from blockzoo.config import load as load_config
    from blockzoo.run_config import RunConfig
    from blockzoo.training.trainer import Trainer

    total = arguments.warmup + arguments.steps
    with tempfile.TemporaryDirectory(prefix="blockzoo-profile-") as directory:
        extra = [f"training.train_iters={total}", "training.log_interval=1", f"training.output_dir={directory}"]
        config = load_config(RunConfig, config_path, [*overrides, *extra])
        if arguments.one_document_per_row:  # as the bare step's tokens
            extra.append(f"data.min_document_length={config.data.sequence_length}")
            config = load_config(RunConfig, config_path, [*overrides, *extra])
        state: dict = {"seen": 0}
        profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])

        def log(message: str) -> None:
            if not STEP_LINE.search(message):
                return
            state["seen"] += 1
            if state["seen"] == arguments.warmup:
                torch.cuda.synchronize()
                profiler.start()
                state["start"] = time.perf_counter()
            elif state["seen"] == total:
                torch.cuda.synchronize()
                state["wall"] = time.perf_counter() - state["start"]
                profiler.stop()

        trainer = Trainer(config, log=log)
        trainer.run()
        trainer.distributed.shutdown()
    report("Trainer", profiler, arguments.steps, state["wall"], arguments.top, arguments.trace)


def trainer_phases(config_path, overrides, arguments) -> None:
    """The host's time in each part of the Trainer's step (see the module's docstring), per step after `--warmup`."""
    from blockzoo.config import load as load_config
    from blockzoo.run_config import RunConfig
    from blockzoo.training.trainer import Trainer

    interval = arguments.log_interval
    total = arguments.warmup + arguments.steps
    with tempfile.TemporaryDirectory(prefix="blockzoo-phases-") as directory:
        extra = [
            f"training.train_iters={total}",
            f"training.log_interval={interval}",
            f"training.output_dir={directory}",
        ]
        if arguments.one_document_per_row:
            length = load_config(RunConfig, config_path, overrides).data.sequence_length
            extra.append(f"data.min_document_length={length}")
        trainer = Trainer(load_config(RunConfig, config_path, [*overrides, *extra]), log=lambda _: None)
        seconds: dict[str, float] = {}
        starts: list[float] = []
        counting = {"on": False}  # from the first timed step's start

        def timed(name: str, function):
            def call(*args, **kwargs):
                begin = time.perf_counter()
                try:
                    return function(*args, **kwargs)
                finally:
                    if counting["on"]:
                        seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - begin

            return call

        train_step = trainer._train_step

        def step(*args, **kwargs):
            counting["on"] = counting["on"] or trainer.step == arguments.warmup
            starts.append(time.perf_counter())
            return train_step(*args, **kwargs)

        trainer._train_step = timed("step (all of it)", step)
        for name, owner, attribute in (
            ("forward + backward", trainer, "forward_backward"),
            ("gradient norm, clipping", trainer.setup.gradient_norm, "clip"),
            ("optimizer step", trainer.optimizer, "step"),
            ("next step's data", trainer, "_prefetch"),
            ("read of the figures (waits)", trainer, "_read_figures"),
        ):
            setattr(owner, attribute, timed(name, getattr(owner, attribute)))
        trainer.save = lambda: None  # no checkpoint: not part of a step
        trainer.run()
        device = trainer.distributed.device
        harness.synchronize(device)
        end = time.perf_counter()
        trainer.distributed.shutdown()
    wall = (end - starts[arguments.warmup]) / arguments.steps
    print(f"\n## Trainer, host time per step ({arguments.steps} steps, a log line every {interval} steps)")
    print(f"  {'wall':32} {wall * 1e3:8.2f} ms")
    for name, value in seconds.items():
        print(f"  {name:32} {value / arguments.steps * 1e3:8.2f} ms")
    config = load_config(RunConfig, config_path, overrides)
    model, optimizer = ours.build(config)
    tokens = ours.random_tokens(
        config.data.micro_batch_size, config.data.sequence_length, config.model.embeddings.vocab_size, device
    )
    timing = harness.time_steps(
        ours.bare_step(model, optimizer, tokens, cuda_graphs=ours.uses_cuda_graphs(config)),
        warmup=arguments.warmup,
        steps=arguments.steps,
        device=device,
    )
    bare = harness.percentile(timing.times_s, 0.5)
    clock = "between CUDA events" if device.type == "cuda" else "wall clock"
    print(f"## bare step (median, {clock}): {bare * 1e3:.1f} ms; the Trainer's wall: {wall / bare - 1:+.1%}")


def main(argv: Sequence[str] | None = None) -> None:
    command = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    command.add_argument("config", nargs="?", default=str(harness.REPOSITORY / "examples" / "gpu_hybrid.yaml"))
    command.add_argument("overrides", nargs="*", help="KEY=VALUE overrides of the config")
    command.add_argument("--steps", type=int, default=6)
    command.add_argument("--warmup", type=int, default=4)
    command.add_argument("--top", type=int, default=15)
    command.add_argument("--trace", type=Path, default=None)
    command.add_argument("--only", choices=["bare", "trainer"], default=None)
    command.add_argument("--phases", action="store_true", help="the host's time per part of the Trainer's step")
    command.add_argument("--log-interval", type=int, default=1, help="with --phases: steps per log line (default 1)")
    command.add_argument(
        "--one-document-per-row",
        action="store_true",
        help="the Trainer's random data in whole rows, as the bare step's (else documents of random lengths)",
    )
    command.add_argument(
        "--llama",
        metavar="ROWSxLENGTH",
        help="profile the bare step of benchmarks/llama.py's Llama-1B in bf16 instead of a config file's model; "
        "the KEY=VALUE overrides apply to it (e.g. training.compile=blocks training.fp8.recipe=tensorwise)",
    )
    command.add_argument(
        "--output-code", action="store_true", help="print the code inductor generates (TORCH_LOGS=output_code)"
    )
    arguments = command.parse_args(argv)
    if arguments.output_code:
        torch._logging.set_logs(output_code=True)
    if not arguments.phases and not torch.cuda.is_available():
        command.error("the profiled steps run on a CUDA GPU; --phases also runs on the CPU")
    from blockzoo.config import load as load_config
    from blockzoo.run_config import RunConfig

    if arguments.llama:
        if "=" in arguments.config:  # no config file: the first override was taken for it
            arguments.overrides.insert(0, arguments.config)
        rows, _, length = arguments.llama.partition("x")
        model = shapes.llama_model(shapes.LLAMA_1B)
        profile_bare(
            ours.run_config(model, ",".join(arguments.overrides), rows=int(rows), length=int(length)), arguments
        )
        return
    if arguments.phases:
        trainer_phases(arguments.config, arguments.overrides, arguments)
        return
    if arguments.only in (None, "bare"):
        profile_bare(load_config(RunConfig, arguments.config, arguments.overrides), arguments)
    if arguments.only in (None, "trainer"):
        profile_trainer(arguments.config, arguments.overrides, arguments)


if __name__ == "__main__":
    main()
