"""What every suite shares: timing, peak memory, one contender's failure kept to itself, the table, JSON lines.

A suite makes `Case`s (one shape of one benchmark) and runs each contender (ours in each setting, each peer) through
`Runner.run`, which times it, records its peak memory and reports an out-of-memory, an absent peer or any error as
that contender's status instead of stopping the run. Every result is printed and written to the JSON-lines file as
soon as it is measured, and each case's table with its ratios when the case is done.

Method (shared/reference/performance-anchors.md §7): warm-up steps, then timed steps, each between two CUDA events;
the median and the 90th percentile; `reset_peak_memory_stats()` + `empty_cache()` before each contender, whose peak
is `max_memory_allocated()`. The first call is timed on its own: its excess over the median (compilation,
autotuning) is reported apart as "first call +s".
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import importlib.metadata
import json
import math
import statistics
import subprocess
import sys
import time
import traceback
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

PEAK_FLOPS = 989e12  # H100/H200 dense bf16, the denominator of MFU (anchors §6)
GIB = 2**30
REPOSITORY = Path(__file__).resolve().parent.parent
# Distributions whose versions every run records (the peers' libraries and what they run on).
VERSIONED = ("torch", "triton", "transformers", "mamba_ssm", "liger_kernel", "torchtitan", "torchao", "blockzoo")


class Absent(Exception):
    """A contender that cannot run here: its library is not installed, or this blockzoo lacks a setting it needs."""


# -- timing ------------------------------------------------------------------------------------------------------------


@dataclass
class Timing:
    """What `time_steps` measured: the first call alone, then each timed call; `first_value` is what the first call
    returned (e.g. the step-0 loss); `extra` holds what a contender adds (a loss difference, a compile time...)."""

    first_s: float
    times_s: list[float]
    first_value: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[], Any], *, warmup: int, steps: int, device: torch.device) -> Timing:
    """Call `step` once (timed alone), `warmup - 1` more times untimed, then `steps` times each timed: between CUDA
    events on a GPU (no synchronization between steps), with the wall clock elsewhere."""
    if warmup < 1 or steps < 1:
        raise ValueError(f"warmup and steps must be at least 1, got {warmup} and {steps}")
    synchronize(device)
    start = time.perf_counter()
    first_value = step()
    synchronize(device)
    first_s = time.perf_counter() - start
    for _ in range(warmup - 1):
        step()
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
        for begin, end in events:
            begin.record()
            step()
            end.record()
        synchronize(device)
        times = [begin.elapsed_time(end) / 1e3 for begin, end in events]
    else:
        times = []
        for _ in range(steps):
            begin = time.perf_counter()
            step()
            times.append(time.perf_counter() - begin)
    return Timing(first_s=first_s, times_s=times, first_value=first_value)


def percentile(values: Sequence[float], fraction: float) -> float:
    """The `fraction` quantile of `values`, linearly interpolated between the two nearest ranks."""
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# -- results -----------------------------------------------------------------------------------------------------------


@dataclass
class Result:
    """One contender's figures in one case. `status`: ok, out of memory, absent, error."""

    contender: str
    ours: bool
    status: str = "ok"
    detail: str = ""
    times_s: list[float] = field(default_factory=list)
    first_s: float | None = None
    peak_gib: float | None = None
    peak_delta_gib: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok" and bool(self.times_s)

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.times_s) if self.times_s else None

    @property
    def p90_s(self) -> float | None:
        return percentile(self.times_s, 0.9) if self.times_s else None

    @property
    def first_call_extra_s(self) -> float | None:
        """How much longer the first call took than the median one (compilation, autotuning, allocations)."""
        if self.first_s is None or self.median_s is None:
            return None
        return max(self.first_s - self.median_s, 0.0)


@dataclass
class Case:
    """One shape of one benchmark. Per step: `tokens` (gives tokens/s), `flops` (TFLOP/s, and MFU when `mfu`),
    `bytes` (GB/s). `memory_delta`: compare the peak above what was allocated before the contender started (kernels,
    whose inputs exist already) rather than the absolute peak (training steps, which build their model)."""

    suite: str
    name: str
    shape: dict[str, Any] = field(default_factory=dict)
    tokens: int | None = None
    flops: float | None = None
    bytes: float | None = None
    mfu: bool = False
    memory_delta: bool = False
    results: list[Result] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def memory(self, result: Result) -> float | None:
        return result.peak_delta_gib if self.memory_delta else result.peak_gib

    def best_ours(self) -> Result | None:
        """Our fastest setting that ran."""
        ours = [result for result in self.results if result.ours and result.ok]
        return min(ours, key=lambda result: result.median_s) if ours else None

    def ratios(self) -> list[dict[str, Any]]:
        """Our fastest setting against each peer that ran: speed = peer time / our time (> 1: ours is faster, the
        ratio of tokens/s), memory = our peak / the peer's (< 1: ours needs less)."""
        best = self.best_ours()
        if best is None:
            return []
        ratios = []
        for peer in self.results:
            if peer.ours or not peer.ok:
                continue
            ours_memory, peer_memory = self.memory(best), self.memory(peer)
            memory = ours_memory / peer_memory if ours_memory is not None and peer_memory else None
            ratios.append(
                {
                    "ours": best.contender,
                    "peer": peer.contender,
                    "speed": peer.median_s / best.median_s,
                    "memory": memory,
                }
            )
        return ratios

    def fastest_peer(self) -> dict[str, Any] | None:
        """Our fastest setting against the fastest peer (the ratio a target is about)."""
        ratios = self.ratios()
        return min(ratios, key=lambda ratio: ratio["speed"]) if ratios else None

    def throughput(self, result: Result) -> dict[str, float]:
        """tokens/s, TFLOP/s, MFU, GB/s of a result at its median time (those the case has figures for)."""
        if not result.ok:
            return {}
        seconds = result.median_s
        figures = {}
        if self.tokens:
            figures["tokens_per_s"] = self.tokens / seconds
        if self.flops:
            figures["tflops"] = self.flops / seconds / 1e12
            if self.mfu:
                figures["mfu"] = self.flops / seconds / PEAK_FLOPS
        if self.bytes:
            figures["gbps"] = self.bytes / seconds / 1e9
        return figures


def result_record(case: Case, result: Result) -> dict[str, Any]:
    """A result as plain JSON data (times in seconds, memory in GiB)."""
    return {
        "contender": result.contender,
        "ours": result.ours,
        "status": result.status,
        "detail": result.detail,
        "median_s": result.median_s,
        "p90_s": result.p90_s,
        "first_s": result.first_s,
        "first_call_extra_s": result.first_call_extra_s,
        "times_s": result.times_s,
        "peak_gib": result.peak_gib,
        "peak_delta_gib": result.peak_delta_gib,
        **case.throughput(result),
        "extra": result.extra,
    }


def case_record(case: Case) -> dict[str, Any]:
    return {
        "record": "case",
        "suite": case.suite,
        "case": case.name,
        "shape": case.shape,
        "tokens": case.tokens,
        "flops": case.flops,
        "bytes": case.bytes,
        "memory": "peak above the start" if case.memory_delta else "peak",
        "notes": case.notes,
        "results": [result_record(case, result) for result in case.results],
        "ratios": case.ratios(),
        "fastest_peer": case.fastest_peer(),
    }


# -- the table ---------------------------------------------------------------------------------------------------------


def _number(value: float | None, digits: int = 1, *, thousands: bool = False) -> str:
    if value is None:
        return "—"
    return f"{value:,.0f}" if thousands else f"{value:.{digits}f}"


def _extra_text(extra: dict[str, Any]) -> str:
    parts = []
    for key, value in extra.items():
        if isinstance(value, float):
            value = f"{value:.3g}"
        parts.append(f"{key} {value}")
    return "; ".join(parts)


def format_case(case: Case) -> str:
    """The case as a table: one row per contender, then our fastest setting's ratio to each peer."""
    columns = ["contender", "status", "median ms", "p90 ms"]
    if case.tokens:
        columns.append("tokens/s")
    if case.flops:
        columns += ["TFLOP/s", "MFU"] if case.mfu else ["TFLOP/s"]
    if case.bytes:
        columns.append("GB/s")
    columns += ["Δpeak GiB" if case.memory_delta else "peak GiB", "first call +s", "notes"]
    rows = []
    for result in case.results:
        figures = case.throughput(result)
        row = [
            result.contender,
            result.status,
            _number(None if result.median_s is None else result.median_s * 1e3, 2),
            _number(None if result.p90_s is None else result.p90_s * 1e3, 2),
        ]
        if case.tokens:
            row.append(_number(figures.get("tokens_per_s"), thousands=True))
        if case.flops:
            row.append(_number(figures.get("tflops")))
            if case.mfu:
                mfu = figures.get("mfu")
                row.append("—" if mfu is None else f"{mfu:.1%}")
        if case.bytes:
            row.append(_number(figures.get("gbps"), 0))
        row += [_number(case.memory(result), 2), _number(result.first_call_extra_s, 1)]
        row.append("; ".join(text for text in (result.detail, _extra_text(result.extra)) if text))
        rows.append(row)
    widths = [max(len(str(row[index])) for row in [columns, *rows]) for index in range(len(columns) - 1)]

    def line(cells: list[str]) -> str:
        padded = [str(cell).ljust(width) for cell, width in zip(cells[:-1], widths)]
        return ("  " + "  ".join(padded) + "  " + str(cells[-1])).rstrip()

    shape = ", ".join(f"{key} {value}" for key, value in case.shape.items())
    text = [f"{case.suite} / {case.name}" + (f" ({shape})" if shape else ""), line(columns)]
    text += [line(row) for row in rows]
    for ratio in case.ratios():
        memory = "—" if ratio["memory"] is None else f"{ratio['memory']:.2f}×"
        text.append(f"  {ratio['ours']} vs {ratio['peer']}: speed {ratio['speed']:.2f}×, memory {memory}")
    if len(case.ratios()) > 1:
        fastest = case.fastest_peer()
        text.append(f"  against the fastest peer ({fastest['peer']}): speed {fastest['speed']:.2f}×")
    if case.best_ours() is None and any(result.ours for result in case.results):
        text.append("  no setting of ours ran: no ratio")
    text += [f"  note: {note}" for note in case.notes]
    return "\n".join(text)


# -- the run's environment ---------------------------------------------------------------------------------------------


def versions() -> dict[str, str | None]:
    """Installed versions of the libraries the figures depend on (None: not installed)."""
    found = {}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def git_commit() -> str | None:
    """The checkout's commit, "+changes" after it when tracked files differ from it (the GPU machine's copy of the
    working tree may sit on an older copy of the history)."""

    def git(*arguments: str) -> subprocess.CompletedProcess | None:
        try:
            return subprocess.run(["git", *arguments], cwd=REPOSITORY, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None

    head = git("rev-parse", "--short", "HEAD")
    if head is None or head.returncode != 0 or not head.stdout.strip():
        return None
    changed = git("diff", "--quiet", "HEAD")
    return head.stdout.strip() + ("+changes" if changed is not None and changed.returncode == 1 else "")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({torch.get_num_threads()} threads)"


def ceilings(device: torch.device) -> dict[str, float]:
    """This GPU's bf16 matrix-product rate (8192³, TFLOP/s) and device-copy bandwidth (1 GiB, GB/s counting the read
    and the write), measured now: the ceilings the figures compare to (anchors §6: about 790 and 4,300 here)."""
    if device.type != "cuda":
        return {}
    size = 8192
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    matmul = time_steps(functools.partial(torch.matmul, a, b), warmup=3, steps=10, device=device)
    source = torch.empty(GIB // 4, device=device, dtype=torch.float32)
    copy = time_steps(source.clone, warmup=2, steps=10, device=device)
    return {
        "matmul_tflops": 2 * size**3 / statistics.median(matmul.times_s) / 1e12,
        "copy_gbps": 2 * GIB / statistics.median(copy.times_s) / 1e9,
    }


def run_header(suite: str, argv: Sequence[str], device: torch.device) -> dict[str, Any]:
    return {
        "record": "run",
        "suite": suite,
        "command": " ".join(["python", *argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device_name(device),
        "versions": versions(),
        "commit": git_commit(),
        "python": sys.version.split()[0],
    }


# -- monkey patches undone -------------------------------------------------------------------------------------------


@contextlib.contextmanager
def restored(*modules: types.ModuleType):
    """Undo on exit what is patched inside (liger-kernel patches transformers' modules globally): each module's
    globals, and the attributes of the classes it defines, as they were on entry."""
    saved = []
    for module in modules:
        classes = {
            cls: dict(vars(cls))
            for cls in vars(module).values()
            if isinstance(cls, type) and cls.__module__ == module.__name__
        }
        saved.append((module, dict(vars(module)), classes))
    try:
        yield
    finally:
        for module, namespace, classes in saved:
            for target, attributes in [(module, namespace), *classes.items()]:
                for name in [name for name in vars(target) if name not in attributes]:
                    delattr(target, name)
                for name, value in attributes.items():
                    if vars(target).get(name) is not value:
                        setattr(target, name, value)


# -- running contenders ------------------------------------------------------------------------------------------------


def clean(device: torch.device) -> None:
    """Free what the last contender left: compiled graphs (they hold its modules), garbage, the allocator's cache."""
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


class Runner:
    """Runs contenders one after the other, each in its own try/except, and writes what they measured as it comes:
    a JSON line per result and per finished case (`path`; none when None), the table on stdout."""

    def __init__(self, suite: str, device: torch.device, path: str | Path | None, argv: Sequence[str]):
        self.suite = suite
        self.device = device
        self.path = None if path is None else Path(path)
        self.cases: list[Case] = []
        header = run_header(suite, argv, device)
        if device.type == "cuda":
            header["ceilings"] = ceilings(device)
            clean(device)
        self.header = header
        self.write(header)
        shown = {key: header[key] for key in ("command", "date", "device", "versions", "commit")}
        print(f"# {suite}: {json.dumps(shown)}", flush=True)
        if "ceilings" in header:
            print(
                f"# ceilings now: bf16 matmul {header['ceilings']['matmul_tflops']:.0f} TFLOP/s, "
                f"copy {header['ceilings']['copy_gbps']:.0f} GB/s",
                flush=True,
            )

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as file:
            file.write(json.dumps(record, default=str) + "\n")

    def run(self, case: Case, contender: str, body: Callable[[], Timing], *, ours: bool = False) -> Result:
        """Run `body` (it builds the contender and returns `time_steps`' timing) with the memory counters reset;
        whatever it raises becomes the result's status (KeyboardInterrupt, the suite's timeout, still stops)."""
        clean(self.device)
        cuda = self.device.type == "cuda"
        baseline = torch.cuda.memory_allocated(self.device) if cuda else 0
        result = Result(contender=contender, ours=ours)
        try:
            timing = body()
            result.times_s, result.first_s, result.extra = timing.times_s, timing.first_s, dict(timing.extra)
        except Absent as error:
            result.status, result.detail = "absent", str(error)
        except Exception as error:  # noqa: BLE001 - one contender's failure is its result, never the run's end
            if is_out_of_memory(error):
                result.status, result.detail = "out of memory", first_line(error)
            else:
                result.status, result.detail = "error", first_line(error)
                print(f"# {case.name} / {contender} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        if cuda:
            peak = torch.cuda.max_memory_allocated(self.device)
            result.peak_gib, result.peak_delta_gib = peak / GIB, (peak - baseline) / GIB
        clean(self.device)
        case.results.append(result)
        self.write({"record": "result", "suite": case.suite, "case": case.name, **result_record(case, result)})
        figures = case.throughput(result)
        median = "" if result.median_s is None else f" {result.median_s * 1e3:.2f} ms"
        tokens = f" {figures['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in figures else ""
        memory = "" if case.memory(result) is None else f" peak {case.memory(result):.2f} GiB"
        detail = f" ({result.detail})" if result.detail else ""
        print(f"  · {case.name} / {contender}: {result.status}{median}{tokens}{memory}{detail}", flush=True)
        return result

    def finish(self, case: Case) -> None:
        """The case is done: its table on stdout, its record (with the ratios) in the JSON lines."""
        self.cases.append(case)
        self.write(case_record(case))
        print(format_case(case) + "\n", flush=True)


# -- the command line --------------------------------------------------------------------------------------------------


def parser(description: str, cases: Sequence[str], *, default_cases: Sequence[str], steps: int, warmup: int):
    """The options every suite takes; a suite adds its own (e.g. `--ours`)."""
    command = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    command.add_argument(
        "--cases",
        nargs="+",
        choices=list(cases),
        default=list(default_cases),
        metavar="CASE",
        help=f"cases to run, in order (of: {', '.join(cases)}; default: {' '.join(default_cases)})",
    )
    command.add_argument("--steps", type=int, default=steps, help=f"timed steps per contender (default {steps})")
    command.add_argument(
        "--warmup", type=int, default=warmup, help=f"steps before the timed ones, the first included (default {warmup})"
    )
    command.add_argument("--json", metavar="PATH", help="append JSON lines (the run, each result, each case) to PATH")
    command.add_argument("--device", default=None, help="cuda (default where there is one) or cpu")
    command.add_argument(
        "--tiny", action="store_true", help="scaled-down shapes: a quick check of the suite's code on any device"
    )
    return command


def parse(command: argparse.ArgumentParser, argv: Sequence[str] | None) -> tuple[argparse.Namespace, torch.device]:
    arguments = command.parse_args(argv)
    if arguments.steps < 1 or arguments.warmup < 1:
        command.error("--steps and --warmup must be at least 1")
    name = arguments.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        command.error("--device cuda: no CUDA device here")
    return arguments, device
