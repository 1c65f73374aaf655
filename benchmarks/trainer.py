"""Suite `trainer`: the Trainer's tokens/s against the bare step of the same model in the same process, and its MFU.

    python benchmarks/trainer.py [--cases gpu gpu_hybrid] [--ours SETTING ...] [--steps 20] [--warmup 5]
        [--log-interval 5] [--json PATH] [--tiny]

Each case is an example config (random tokens): `gpu` (examples/gpu.yaml, a 100M transformer) and `gpu_hybrid`
(examples/gpu_hybrid.yaml, 8 Mamba 2 + 4 attention blocks). For each `--ours` setting (benchmarks/ours.py), the
Trainer (`blockzoo.training.trainer.Trainer` in this process: `warmup + steps` steps, a log line every
`--log-interval` steps (the host reads the device at those only), output under a temporary directory, its one
checkpoint at the end, after the timing) is timed from its log lines (each step: its interval's mean; the first
call's excess: the first interval's time less the median of the others' steps), and the
bare step (build, `parallelize`, optimizer, loss, backward, step; no data pipeline, no clipping, no logging;
under `cuda_graphs=true` its loss and backward pass replayed as one CUDA graph, as the Trainer's) on
random tokens of the same shape, one document per row in both (the Trainer's random dataset told so). Both take
their model from the same seed. MFU as the Trainer reports it: the
layers' own FLOP counts over 989 TFLOP/s. Targets: Trainer overhead ≤ 3% of the bare step (speed ratio
≥ 0.97); gpu_hybrid's MFU through the Trainer ≥ 21% (2× the 10.5% measured on 2026-11-30).
"""

from __future__ import annotations

import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/trainer.py`: see llama.py
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch

from benchmarks import harness, ours

SUITE = "trainer"
EXAMPLES = harness.REPOSITORY / "examples"
CASES = {"gpu": EXAMPLES / "gpu.yaml", "gpu_hybrid": EXAMPLES / "gpu_hybrid.yaml"}
DEFAULT_OURS = ["compile=none", "compile=blocks"]
# --tiny: the example's blocks and vocabulary, a few short rows (the hybrid keeps one ssm, ssm, attn pattern)
TINY = {
    "gpu": [
        "model.decoder.num_blocks=2",
        "model.decoder.block.mixer.heads=2",
        "model.decoder.block.mixer.head_groups=1",
        "model.decoder.block.mlp.intermediate_size=128",
    ],
    "gpu_hybrid": [
        "model.decoder.num_blocks=3",
        "model.decoder.blocks.ssm.mixer.heads=2",
        "model.decoder.blocks.ssm.mlp.intermediate_size=128",
        "model.decoder.blocks.attn.mixer.heads=2",
        "model.decoder.blocks.attn.mixer.head_groups=1",
        "model.decoder.blocks.attn.mlp.intermediate_size=128",
    ],
}
TINY_COMMON = [
    "model.hidden_size=64",
    "model.embeddings.vocab_size=256",
    "data.sequence_length=32",
    "data.micro_batch_size=2",
    "training.cuda_graphs=false",  # both examples graph their steps, which needs CUDA: --tiny checks the code on a CPU
]
STEP_LINE = re.compile(r"\bstep (\d+)/(\d+)\b")


def load(case: str, setting: str, extra: Sequence[str] = (), *, tiny: bool = False):
    """The case's run config with the setting and `extra` overrides applied (Absent if this blockzoo refuses them)."""
    from blockzoo.config import ConfigError
    from blockzoo.config import load as load_config
    from blockzoo.run_config import RunConfig

    changes = [*(TINY_COMMON + TINY[case] if tiny else []), *ours.overrides(setting), *extra]
    try:
        return load_config(RunConfig, CASES[case], changes)
    except ConfigError as error:
        raise harness.Absent(f"this blockzoo refuses {setting!r} on {CASES[case].name}: {error}") from None


def step_times(stamps: Sequence[tuple[int, float]], start: float) -> list[float]:
    """Seconds of each step from the (step, time) its log lines arrived: a line every few steps gives each step of
    its interval the interval's mean (the first interval from step 0 at `start`)."""
    times, previous_step, previous = [], 0, start
    for step, stamp in sorted(stamps):
        times += [(stamp - previous) / (step - previous_step)] * (step - previous_step)
        previous_step, previous = step, stamp
    return times


class Suite:
    def __init__(self, arguments, device: torch.device, runner: harness.Runner):
        self.arguments, self.device, self.runner = arguments, device, runner

    def run(self, case_name: str, settings: Sequence[str]) -> None:
        config = load(case_name, "default", tiny=self.arguments.tiny)
        rows, length = config.data.micro_batch_size, config.data.sequence_length
        case = harness.Case(
            SUITE,
            case_name,
            shape={"config": f"examples/{CASES[case_name].name}", "rows": rows, "length": length},
            tokens=rows * length,
            flops=model_flops(config),
            mfu=True,
        )
        for setting in settings:
            with ours.environment(setting):
                trainer = self.runner.run(
                    case, f"Trainer ({setting})", lambda s=setting: self.trainer(case_name, s), ours=True
                )
                bare = self.runner.run(case, f"bare step ({setting})", lambda s=setting: self.bare(case_name, s))
            if trainer.ok and bare.ok:
                overhead = trainer.median_s / bare.median_s - 1
                case.notes.append(
                    f"{setting}: the Trainer's step takes {overhead:+.1%} over the bare one (target ≤ +3%)"
                )
        self.runner.finish(case)

    def trainer(self, case: str, setting: str) -> harness.Timing:
        from blockzoo.training.trainer import Trainer

        total = self.arguments.warmup + self.arguments.steps
        with tempfile.TemporaryDirectory(prefix="blockzoo-bench-") as directory:
            interval = self.arguments.log_interval
            extra = [
                f"training.train_iters={total}",
                f"training.log_interval={interval}",
                f"training.output_dir={directory}",
            ]
            config = load(case, setting, extra, tiny=self.arguments.tiny)
            # One document per row, as the bare step's tokens: the random dataset's documents of random lengths
            # would make the Trainer's step other work (varlen attention, SSM resets), not overhead.
            length = config.data.sequence_length
            extra.append(f"data.min_document_length={length}")
            config = load(case, setting, extra, tiny=self.arguments.tiny)
            stamps: list[tuple[int, float]] = []
            lines: list[str] = []

            def log(message: str) -> None:
                match = STEP_LINE.search(message)
                if match:
                    stamps.append((int(match.group(1)), time.perf_counter()))
                    lines.append(message)

            trainer = Trainer(config, log=log)
            # parallelize replaces the blocks' forward on the instances: a Trainer that does not apply it runs plain
            policies = ours.uses_policies(config)
            applied = any("forward" in vars(block) for block in trainer.model.decoder)
            harness.synchronize(self.device)
            start = time.perf_counter()
            trainer.run()
            trainer.distributed.shutdown()
        times = step_times(stamps, start)
        if len(times) != total:
            raise RuntimeError(f"expected {total} step log lines, got {len(times)}")
        timed = times[self.arguments.warmup :]
        first_s = sum(times[:interval]) - (interval - 1) * statistics.median(timed)
        timing = harness.Timing(first_s=first_s, times_s=timed)
        timing.extra = {"last log": lines[-1].split("] ", 1)[-1]}
        if policies:
            timing.extra["the Trainer applied the setting"] = applied
        return timing

    def bare(self, case: str, setting: str) -> harness.Timing:
        config = load(case, setting, tiny=self.arguments.tiny)
        model, optimizer = ours.build(config)
        tokens = ours.random_tokens(
            config.data.micro_batch_size, config.data.sequence_length, config.model.embeddings.vocab_size, self.device
        )
        step = ours.bare_step(model, optimizer, tokens, cuda_graphs=ours.uses_cuda_graphs(config))
        return harness.time_steps(step, warmup=self.arguments.warmup, steps=self.arguments.steps, device=self.device)


def model_flops(config) -> float | None:
    """Forward + backward FLOPs of one micro-batch by the layers' own counts (what the Trainer's MFU uses)."""
    from benchmarks import shapes
    from blockzoo.layers.base import Batch

    try:
        model = shapes.our_model(config.model)
    except Exception:  # noqa: BLE001 - the figure is optional
        return None
    forward, backward = model.flops(Batch([config.data.sequence_length] * config.data.micro_batch_size))
    return float(forward + backward)


def main(argv: Sequence[str] | None = None) -> None:
    command = harness.parser(__doc__, list(CASES), default_cases=list(CASES), steps=20, warmup=5)
    command.add_argument("--ours", nargs="+", metavar="SETTING", help=f"our settings (default: {DEFAULT_OURS})")
    command.add_argument(
        "--log-interval",
        type=int,
        default=5,
        help="the Trainer's steps per log line (default 5: divides --warmup and --steps)",
    )
    arguments, device = harness.parse(command, argv)
    interval = arguments.log_interval
    if interval < 1 or arguments.warmup % interval or arguments.steps % interval:
        command.error(
            f"--log-interval {interval} must divide --warmup ({arguments.warmup}) and --steps ({arguments.steps})"
        )
    command_line = sys.argv if argv is None else ["benchmarks/trainer.py", *argv]
    suite = Suite(arguments, device, harness.Runner(SUITE, device, arguments.json, command_line))
    for case in arguments.cases:
        suite.run(case, arguments.ours or DEFAULT_OURS)


if __name__ == "__main__":
    main()
