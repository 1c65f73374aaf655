"""The trackers' cost per step: the Trainer with every first-party tracker on (jsonl, tensorboard, wandb offline,
mlflow on its SQLite store) against jsonl alone, same model, same data, same process.

    python benchmarks/trackers.py [--case gpu] [--steps 60] [--warmup 10] [--rounds 3] [--log-interval 1] [--tiny]
        [--hidden-size N] [--threads N] [--configurations jsonl tensorboard wandb mlflow all all-threads]
    python benchmarks/trackers.py --per-call 500

Each round trains each configuration in turn (`--configurations`: the first is the base; default `jsonl all`), each
into a fresh temporary directory. A step is the interval between the training loop's hand-offs of two consecutive
logged steps to the trackers (`Trainer._record`), measured three ways: wall time (training, the trackers' queue
puts, and whatever the trackers' background threads take from the loop, the GIL included; on a loaded machine, also
everything else it runs), the loop thread's own CPU time (`time.thread_time`: its work, queue puts included), and the
process's CPU time (`time.process_time`: every thread of the training process, trackers on threads included).
`--log-interval 1` (the default) is the worst case: every step hands its figures over. Reported: the median step of
each configuration over all rounds (after `--warmup` steps) and its overhead against the base, and the wall time of
each configuration's least disturbed round (its best round median). Target (docs/tracking.md): ≤ 1 % of the wall
time with all four. Needs blockzoo-tensorboard, -wandb and -mlflow.

`--per-call LOGS` measures each tracker alone, outside the trainer: its start's wall time, the CPU time of a log call
on its thread (median of LOGS calls; little affected by the machine's other load, unlike the wall times), its
finish, and the CPU time of all its log calls and its finish per logged step (a batching tracker sends at the end);
each called on the thread, and run in a child process (`separate_process`: the thread's part is the pipe).

The trackers of other libraries run in child processes by default (`separate_process`): `all` is that, `all-threads`
the same trackers on threads of the training process. The trackers' processes' CPU (from /proc, in 10 ms ticks, so
a mean over the run) is reported beside the training process's, and added to it.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/trackers.py`: see llama.py
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from benchmarks import trainer as trainer_suite

ALL = (
    "training.trackers={tb: {type: tensorboard}, wb: {type: wandb, mode: offline}, "
    "ml: {type: mlflow, experiment: trackers-benchmark}}"
)
ALL_ON_THREADS = (  # as before the trackers had processes of their own
    "training.trackers={tb: {type: tensorboard, separate_process: false}, "
    "wb: {type: wandb, mode: offline, separate_process: false}, "
    "ml: {type: mlflow, experiment: trackers-benchmark, separate_process: false}}"
)
CONFIGURATIONS = {
    "jsonl": (),
    "tensorboard": ("training.trackers={tb: {type: tensorboard}}",),
    "wandb": ("training.trackers={wb: {type: wandb, mode: offline}}",),
    "mlflow": ("training.trackers={ml: {type: mlflow, experiment: trackers-benchmark}}",),
    "all": (ALL,),
    "all-threads": (ALL_ON_THREADS,),
}


CLOCKS = {"wall": time.perf_counter, "loop CPU": time.thread_time, "process CPU": time.process_time}
CHILDREN = "trackers' processes CPU"  # read from /proc in clock ticks (10 ms): reported as a mean, not a median


def children_cpu(trainer) -> float:
    """CPU seconds so far of the trackers' child processes (`separate_process`), from /proc (Linux)."""
    total = 0
    for worker in trainer._trackers._workers if trainer._trackers is not None else ():
        process = getattr(worker.tracker, "process", None)
        if process is None:
            continue
        try:
            fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def step_times(case: str, extra: list[str], *, tiny: bool, warmup: int, per: int) -> dict[str, list[float]]:
    """Seconds per step between consecutive logged steps (`per` steps apart) of one run of `case` on each clock, after
    `warmup` of them."""
    from blockzoo.training.trainer import Trainer

    stamps: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as directory:
        changes = [f"training.output_dir={directory}", "training.checkpoint_interval=null", *extra]
        config = trainer_suite.load(case, "default", changes, tiny=tiny)
        with Trainer(config, log=lambda _: None) as trainer:
            record = trainer._record

            def timed_record(entry):
                if not stamps and trainer._trackers is not None:
                    # The trackers' start (wandb.init, MLflow's database) runs once per run on their own threads:
                    # waited for before the timed steps (`--per-call` measures it).
                    for worker in trainer._trackers._workers:
                        worker.wait(None)
                stamps.append({**{name: clock() for name, clock in CLOCKS.items()}, CHILDREN: children_cpu(trainer)})
                record(entry)

            trainer._record = timed_record
            trainer.run()
    return {
        name: [(later[name] - earlier[name]) / per for earlier, later in itertools.pairwise(stamps)][warmup:]
        for name in [*CLOCKS, CHILDREN]
    }


ENTRY = {  # a logged step of a small run: what metrics.jsonl gets
    "tokens": 65536,
    "seconds": 12.5,
    "loss": 5.25,
    "learning_rate": 3.0e-4,
    "gradient_norm": 0.75,
    "tokens_per_second": 210000.0,
    "tflops": 400.0,
    "mfu": 0.4,
    "decoder.1.mlp.load_balancing": 0.01,
    "source_tokens": {"web": 40000, "code": 25536},
}
TRACKERS = {
    "jsonl": {"type": "jsonl"},
    "tensorboard": {"type": "tensorboard"},
    "wandb": {"type": "wandb", "mode": "offline"},
    "mlflow": {"type": "mlflow", "experiment": "trackers-benchmark"},
    "mlflow, flush_seconds 0": {"type": "mlflow", "experiment": "trackers-benchmark", "flush_seconds": 0},
}


def per_call(logs: int) -> None:
    """Each tracker alone, outside the trainer: its start's wall time, and the CPU time of its thread per log call
    (`time.thread_time`: what it takes from the process, whatever else the machine runs), median of `logs` calls.
    Each tracker twice: called on this thread, and run in a child process (`ChildProcessTracker`, as
    `separate_process` runs it), where this thread's part is pickling each call onto the pipe."""
    from blockzoo.config import structure
    from blockzoo.plugins import get_registry
    from blockzoo.training.tracker_process import ChildProcessTracker
    from blockzoo.training.tracking import RunStatus, TrackerRun
    from blockzoo.training.tracking_config import TrackerConfig

    for (name, data), child in itertools.product(TRACKERS.items(), (False, True)):
        config = structure(data, TrackerConfig)
        tracker = ChildProcessTracker(config) if child else get_registry().implementation_of(config)(config)
        with tempfile.TemporaryDirectory() as directory:
            run = TrackerRun(config={}, parameters={}, output_dir=Path(directory), start_step=0, name=name)
            started = time.perf_counter()
            tracker.start(run)
            start_seconds = time.perf_counter() - started
            costs = []
            for step in range(1, logs + 1):
                before = time.thread_time()
                tracker.log(step, {"step": step, **ENTRY})
                costs.append(time.thread_time() - before)
            started, before = time.perf_counter(), time.thread_time()
            tracker.finish(RunStatus(state="finished", step=logs))
            finish_seconds, finish_cpu = time.perf_counter() - started, time.thread_time() - before
        per_step = (sum(costs) + finish_cpu) / logs  # what finish sends (a batching tracker's rest) counted too
        where = "in a child process, this thread's part" if child else "on this thread"
        print(
            f"{name} ({where}): start {start_seconds:.2f} s, log {statistics.median(costs) * 1e3:.3f} ms CPU (median "
            f"of {logs}), finish {finish_seconds:.2f} s; all calls {per_step * 1e3:.3f} ms CPU per logged step"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", default="gpu", choices=sorted(trainer_suite.CASES))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--log-interval", type=int, default=1)
    parser.add_argument("--tiny", action="store_true", help="the case's --tiny shape of the trainer suite (CPU)")
    parser.add_argument("--hidden-size", type=int, default=None, help="override model.hidden_size")
    parser.add_argument(
        "--configurations", nargs="+", default=["jsonl", "all"], choices=sorted(CONFIGURATIONS), help="first: the base"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU: 1 spins least)")
    parser.add_argument("--per-call", type=int, metavar="LOGS", help="measure each tracker alone (LOGS log calls)")
    arguments = parser.parse_args(argv)
    if arguments.per_call:
        per_call(arguments.per_call)
        return
    interval = arguments.log_interval
    common = [f"training.train_iters={arguments.steps}", f"training.log_interval={interval}"]
    if arguments.hidden_size:
        common.append(f"model.hidden_size={arguments.hidden_size}")
    if arguments.threads:
        import torch

        torch.set_num_threads(arguments.threads)
    names = arguments.configurations
    times: dict[str, dict[str, list[float]]] = {name: {clock: [] for clock in [*CLOCKS, CHILDREN]} for name in names}
    round_medians: dict[str, list[float]] = {name: [] for name in names}  # wall
    for round_index in range(arguments.rounds):
        for name in names:
            changes = [*common, *CONFIGURATIONS[name]]
            run = step_times(arguments.case, changes, tiny=arguments.tiny, warmup=arguments.warmup, per=interval)
            for clock, values in run.items():
                times[name][clock] += values
            round_medians[name].append(statistics.median(run["wall"]))
            medians = ", ".join(f"{clock} {statistics.median(run[clock]) * 1e3:.2f}" for clock in CLOCKS)
            medians += f", {CHILDREN} (mean) {statistics.fmean(run[CHILDREN]) * 1e3:.2f}"
            print(f"round {round_index + 1} {name}: median ms/step {medians} ({len(run['wall'])} steps)")
    print(f"{arguments.case}{' --tiny' if arguments.tiny else ''}, log every {arguments.log_interval} step(s):")
    for clock in CLOCKS:
        base = statistics.median(times[names[0]][clock])
        figures = [f"{names[0]} {base * 1e3:.2f} ms/step"]
        for name in names[1:]:
            median = statistics.median(times[name][clock])
            figures.append(f"{name} {median * 1e3:.2f} ms/step ({median / base - 1:+.2%})")
        print(f"  {clock}: " + ", ".join(figures))
    # The trackers' processes, added to the training process's CPU: everything the trackers cost the machine.
    totals = {
        name: statistics.median(times[name]["process CPU"]) + statistics.fmean(times[name][CHILDREN]) for name in names
    }
    figures = [
        f"{name} {totals[name] * 1e3:.2f} ms/step ({totals[name] / totals[names[0]] - 1:+.2%})" for name in names
    ]
    print(f"  process CPU + {CHILDREN}: " + ", ".join(figures))
    # On a machine other work shares, the least disturbed round of each configuration is the steadier comparison.
    best = {name: min(medians) for name, medians in round_medians.items()}
    figures = [f"{name} {best[name] * 1e3:.2f} ms/step ({best[name] / best[names[0]] - 1:+.2%})" for name in names]
    print("  wall, best round: " + ", ".join(figures))


if __name__ == "__main__":
    main()
