"""FP8 against bf16 over a training run: does FP8 train the Llama-1B shape as bf16 does?

    python benchmarks/fp8_losses.py [--rows 4] [--length 4096] [--steps 200] [--log-interval 10]
        [--recipes tensorwise ...] [--compile blocks] [--json PATH] [--tiny]

The Llama suite's model (benchmarks/shapes.py) trained through the Trainer on the embedded story corpus (byte
tokens: learnable, unlike the suites' random tokens, so the losses fall and a precision that trains worse shows),
once in bf16 and once per FP8 recipe (`training.fp8.recipe`), from the same seed and the same batches. Printed, per log
interval: each run's mean loss, and for each FP8 run the relative difference of that mean from bf16's and the largest
difference of one step's loss; then the largest over the run. Goal: every step's loss within 1 % of bf16's.

`--tiny`: the tiny Llama shape on the CPU, FP8 through torchao's emulation (which needs `--compile none`): a check
of this script's code, not of FP8.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/fp8_losses.py`: see llama.py
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch

from benchmarks import shapes

GOAL = 0.01
BYTE_VOCABULARY = 257  # the byte tokenizer's ids and its end of document: the tiny shape's vocabulary is 256
STORY_TOKENS = 400  # below a story's mean (476 bytes): the training split holds more tokens than the run reads


def run_config(arguments, fp8: str | None, output_dir: str):
    """The run config of one run: bf16 when `fp8` is None, else that FP8 recipe."""
    from blockzoo.config import load
    from blockzoo.run_config import RunConfig

    shape = shapes.LLAMA_TINY if arguments.tiny else shapes.LLAMA_1B
    tokens = arguments.rows * arguments.length * arguments.steps
    data = {
        "model": shapes.llama_model(shape),
        "distributed": {"compute_dtype": "bf16"},
        "data": {
            "type": "embedded",
            "num_documents": tokens // STORY_TOKENS + 100,
            "sequence_length": arguments.length,
            "micro_batch_size": arguments.rows,
        },
        "training": {
            "train_iters": arguments.steps,
            "log_interval": arguments.log_interval,
            "compile": arguments.compile,
            "optimizer": {"type": "adamw", "learning_rate": arguments.learning_rate},
            "schedule": {"warmup_iters": max(1, arguments.steps // 10)},
            "output_dir": output_dir,
        },
    }
    overrides = [f"model.embeddings.vocab_size={BYTE_VOCABULARY}"] if arguments.tiny else []
    if fp8 is not None:
        overrides.append(f"training.fp8={{recipe: {fp8}, emulate: {str(arguments.tiny).lower()}}}")
    return load(RunConfig, data=data, overrides=overrides)


def train(arguments, fp8: str | None) -> dict[int, float]:
    """{step: loss} of every step of one run."""
    from blockzoo.training.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="blockzoo-fp8-losses-") as directory:
        trainer = Trainer(run_config(arguments, fp8, directory), log=lambda line: print(f"  {line}", flush=True))
        records = trainer.run()
        trainer.distributed.shutdown()
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {record.step: record.loss for record in records}


def difference(reference: float, other: float) -> float:
    return abs(other - reference) / abs(reference)


def table(runs: dict[str, dict[int, float]], interval: int) -> list[str]:
    """A line per `interval` steps: each run's mean loss over them, and for each FP8 run the relative difference of
    that mean from bf16's and the largest difference of a single step's loss."""
    names, reference = list(runs), runs["bf16"]
    steps = sorted(reference)
    header = "steps     " + "".join(f"{name:>16}" for name in names)
    lines = [header + "".join(f"{'Δ mean ' + name:>22}{'Δ largest':>11}" for name in names[1:])]
    for first in range(0, len(steps), interval):
        window = steps[first : first + interval]
        means = {name: sum(runs[name][step] for step in window) / len(window) for name in names}
        line = f"{window[0]:>4}-{window[-1]:<4} " + "".join(f"{means[name]:16.5f}" for name in names)
        for name in names[1:]:
            largest = max(difference(reference[step], runs[name][step]) for step in window)
            line += f"{difference(means['bf16'], means[name]):22.2%}{largest:11.2%}"
        lines.append(line)
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    command = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    command.add_argument("--rows", type=int, default=4)
    command.add_argument("--length", type=int, default=4096)
    command.add_argument("--steps", type=int, default=200)
    command.add_argument("--log-interval", type=int, default=10)
    command.add_argument("--learning-rate", type=float, default=3e-4)
    command.add_argument("--recipes", nargs="+", default=["tensorwise"], help="FP8 recipes (default: tensorwise)")
    command.add_argument("--compile", default="blocks", help="training.compile (default: blocks)")
    command.add_argument("--json", type=Path, help="write the losses and differences as JSON")
    command.add_argument("--tiny", action="store_true", help="the tiny shape on the CPU, FP8 emulated")
    arguments = command.parse_args(argv)
    if arguments.tiny:
        arguments.compile = "none"

    runs = {"bf16": train(arguments, None)}
    for recipe in arguments.recipes:
        runs[f"fp8 {recipe}"] = train(arguments, recipe)
    print("\n".join(table(runs, arguments.log_interval)))
    reference = runs.pop("bf16")
    worst = {name: max(difference(reference[step], run[step]) for step in reference) for name, run in runs.items()}
    for name, largest in worst.items():
        verdict = "met" if largest <= GOAL else "not met"
        print(f"{name}: largest difference of a step's loss from bf16's {largest:.3%} (goal ≤ {GOAL:.0%}: {verdict})")
    if arguments.json:
        record = {"losses": {"bf16": reference, **runs}, "largest_difference": worst}
        arguments.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
