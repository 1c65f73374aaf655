"""Where a training step's memory goes: the bare step of a suite's model, its peak taken apart.

    python benchmarks/memory_step.py [mamba2 | llama | CONFIG.yaml] [--rows 4] [--length 4096]
        [--ours SETTING] [--warmup 2] [--top 20] [--time-steps N]

After `--warmup` steps (autotuning, compilation) it runs one more step of `benchmarks/ours.py`'s bare step in three
parts (forward with the loss, backward, optimizer), printing the memory held before the step (weights, optimizer
state) and each part's peak; with the CUDA allocator's history recorded through that step, it replays the
allocations to the step's peak and prints what was alive then, grouped by the line of Python that allocated it
(the innermost frame outside torch; inside a compiled block, a line of the compiler's generated code), largest
first. `--time-steps N` then times N steps (the median). The timing suites say how much; this says what.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/memory_step.py`: see llama.py
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch

from benchmarks import harness, ours, shapes

GIB = 2**30
MODELS = {"mamba2": lambda: shapes.mamba2_model(shapes.MAMBA2_1B), "llama": lambda: shapes.llama_model(shapes.LLAMA_1B)}


def run_config(model: str, setting: str, rows: int, length: int):
    if model in MODELS:
        return ours.run_config(MODELS[model](), setting, rows=rows, length=length)
    from blockzoo.config import load as load_config
    from blockzoo.run_config import RunConfig

    changes = [f"data.micro_batch_size={rows}", f"data.sequence_length={length}", *ours.overrides(setting)]
    return load_config(RunConfig, model, changes)


def step_in_parts(model, optimizer, tokens: torch.Tensor) -> dict[str, float]:
    """One bare step, the peak of each part (GiB) and what is held before it."""
    from blockzoo.layers.base import Batch

    rows, length = tokens.shape
    labels = ours.next_token_labels(tokens)
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    figures = {"held before the step": torch.cuda.memory_allocated() / GIB}
    torch.cuda.reset_peak_memory_stats()
    cross_entropy, losses = model.loss(tokens.flatten(), labels, Batch([length] * rows, device=tokens.device))
    total = cross_entropy / (rows * (length - 1)) + sum(losses.values(), torch.zeros((), device=tokens.device))
    torch.cuda.synchronize()
    figures |= {"forward peak": torch.cuda.max_memory_allocated() / GIB, "after forward": _held()}
    torch.cuda.reset_peak_memory_stats()
    total.backward()
    del total, cross_entropy, losses
    torch.cuda.synchronize()
    figures |= {"backward peak": torch.cuda.max_memory_allocated() / GIB, "after backward": _held()}
    torch.cuda.reset_peak_memory_stats()
    optimizer.step()
    torch.cuda.synchronize()
    figures |= {"optimizer peak": torch.cuda.max_memory_allocated() / GIB, "after the step": _held()}
    return figures


def _held() -> float:
    return torch.cuda.memory_allocated() / GIB


def origin(frames) -> str:
    """The innermost frame outside torch's own files (the line that asked for the memory)."""
    for frame in frames:
        name = frame["filename"]
        if "/torch/" not in name and not name.startswith("<") and "/triton/" not in name:
            return f"{Path(name).parent.name}/{Path(name).name}:{frame['line']} {frame['name']}"
    return frames[0]["name"] if frames else "(no Python frame: the allocator or a C++ caller)"


def peak_contents(trace) -> tuple[int, list[tuple[str, int, int]]]:
    """Replay the allocator's trace to its peak: (peak bytes, [(origin, bytes, blocks)] alive then, largest first).
    Blocks alive before the recording began are not in the trace: the peak counted is the step's own."""
    live: dict[int, tuple[int, list]] = {}
    current = peak = peak_index = 0
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], event.get("frames", []))
            current += event["size"]
            if current > peak:
                peak, peak_index = current, index
        elif event["action"] == "free_completed" and event["addr"] in live:
            current -= live.pop(event["addr"])[0]
    live.clear()
    for event in trace[: peak_index + 1]:  # again, up to the peak, keeping the origins
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], event.get("frames", []))
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    sizes: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    for size, frames in live.values():
        sizes[origin(frames)] += size
        counts[origin(frames)] += 1
    return peak, [(name, size, counts[name]) for name, size in sizes.most_common()]


def main(argv=None) -> None:
    command = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    command.add_argument("model", nargs="?", default="mamba2", help="mamba2, llama or an example config's path")
    command.add_argument("--rows", type=int, default=4)
    command.add_argument("--length", type=int, default=4096)
    command.add_argument("--ours", default="compile=blocks,recompute=selective", help="a setting (benchmarks/ours.py)")
    command.add_argument("--warmup", type=int, default=2)
    command.add_argument("--top", type=int, default=20)
    command.add_argument("--time-steps", type=int, default=0, help="then time this many steps (median ms, tokens/s)")
    arguments = command.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/memory_step.py needs a CUDA device")
    config = run_config(arguments.model, arguments.ours, arguments.rows, arguments.length)
    model, optimizer = ours.build(config)
    print(
        f"# {arguments.model} {arguments.rows}×{arguments.length}, {arguments.ours}, "
        f"{shapes.parameter_count(model) / 1e9:.3f}B parameters, {harness.device_name(torch.device('cuda'))}"
    )
    tokens = ours.random_tokens(arguments.rows, arguments.length, config.model.embeddings.vocab_size, "cuda")
    step = ours.bare_step(model, optimizer, tokens, cuda_graphs=ours.uses_cuda_graphs(config))
    for _ in range(arguments.warmup):
        step()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        figures = step_in_parts(model, optimizer, tokens)
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    for name, value in figures.items():
        print(f"{name:>22}: {value:7.2f} GiB")
    if arguments.time_steps:
        timing = harness.time_steps(step, warmup=1, steps=arguments.time_steps, device=torch.device("cuda"))
        median = harness.percentile(timing.times_s, 0.5)
        speed = tokens.numel() / median
        print(f"{'step':>22}: {median * 1e3:7.2f} ms (median of {arguments.time_steps}), {speed:,.0f} tokens/s")
    peak, contents = peak_contents(trace)
    print(f"\n# the step's own allocations at their peak: {peak / GIB:.2f} GiB (over what was held before the step)")
    for name, size, blocks in contents[: arguments.top]:
        print(f"{size / GIB:8.3f} GiB {blocks:6d} blocks  {name}")


if __name__ == "__main__":
    main()
