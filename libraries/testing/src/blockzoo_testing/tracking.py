"""Helpers of a tracker plugin's tests: tiny runs of the real trainer (a few steps of a one-block model on the
embedded corpus, seconds on the CPU), a run killed after a checkpoint and resumed, and the figures of its
`metrics.jsonl` that a tracker must hold too.

```python
straight, resumed = straight_and_resumed(tmp_path, "training.trackers={tb: {type: tensorboard}}")
assert read_my_tracker(resumed) == logged_figures(straight, DETERMINISTIC)
```
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from blockzoo.config import load
from blockzoo.run_config import RunConfig
from blockzoo.training.metrics import METRICS_FILE, read_metrics
from blockzoo.training.tracking import scalar_figures

TINY_RUN: dict[str, Any] = {
    "model": {
        "hidden_size": 16,
        "embeddings": {"vocab_size": 257},  # the byte tokenizer of the embedded corpus
        "decoder": {"num_blocks": 1, "block": {"mixer": {"type": "none"}, "mlp": {"type": "none"}}},
    },
    "distributed": {"backend": "gloo"},
    "data": {"type": "embedded", "sequence_length": 32, "micro_batch_size": 2, "num_documents": 4},
    "training": {
        "train_iters": 8,
        "optimizer": {"learning_rate": 0.01},
        "schedule": {"decay": "cosine"},
        "log_interval": 1,
        "checkpoint_interval": 4,
    },
}

# The figures two runs of one config log alike (the others measure time).
DETERMINISTIC = ("tokens", "loss", "learning_rate", "gradient_norm", "evaluation_loss")


def tiny_run_config(output_dir: str | Path, *overrides: str) -> RunConfig:
    """`TINY_RUN` writing to `output_dir`, with `key=value` overrides as on the command line."""
    return load(RunConfig, data=TINY_RUN, overrides=[f"training.output_dir={output_dir}", *overrides])


def train_tiny(config: RunConfig, log: Callable[[str], None] | None = None) -> list[str]:
    """Train `config` in this process; the run's log lines."""
    from blockzoo.training.trainer import Trainer

    messages: list[str] = []

    def record(message: str) -> None:
        messages.append(message)
        if log is not None:
            log(message)

    with Trainer(config, log=record) as trainer:
        trainer.run()
    return messages


class Killed(Exception):
    """Raised from a run's log to stop it the way a crash would: no checkpoint, no graceful end."""


def train_killed_at(config: RunConfig, step: int) -> list[str]:
    """Train `config` (logging every step) until the log line of the step after `step`, and crash there: `step`'s
    figures went to the trackers, no checkpoint after `step`'s was written; the run's log lines."""
    messages: list[str] = []

    def crash_at_step(message: str) -> None:
        messages.append(message)
        if message.startswith(f"step {step + 1}/"):
            raise Killed(f"killed after step {step}")

    try:
        train_tiny(config, log=crash_at_step)
    except Killed:
        return messages
    raise AssertionError(f"the run never logged step {step}")


def straight_and_resumed(root: Path, *overrides: str, killed_at: int = 6) -> tuple[Path, Path]:
    """Two runs of `TINY_RUN` with `overrides`: `root/straight` trained to the end in one go, and `root/resumed`
    killed at step `killed_at` (after its checkpoint of step 4) then resumed to the end. Their output directories."""
    straight, resumed = root / "straight", root / "resumed"
    train_tiny(tiny_run_config(straight, *overrides))
    train_killed_at(tiny_run_config(resumed, *overrides), killed_at)
    train_tiny(tiny_run_config(resumed, *overrides))
    return straight, resumed


def logged_figures(output_dir: Path, names: Iterable[str] | None = None) -> dict[int, dict[str, float]]:
    """The figures of `output_dir`'s `metrics.jsonl` by step, flat (`scalar_figures`), only `names` if given."""
    wanted = None if names is None else set(names)
    return {
        entry["step"]: {
            name: value for name, value in scalar_figures(entry).items() if wanted is None or name in wanted
        }
        for entry in read_metrics(output_dir / METRICS_FILE)
    }
