"""The run's metrics file, `metrics.jsonl` in its output directory: one JSON object per line for every step that
logged something (a training line, an evaluation or both), with every figure of it. JSON lines, not TensorBoard
event files: read by any tool (`pandas.read_json(path, lines=True)`, `jq`, a few lines of Python) with no
dependency, appended to line by line (a killed run leaves at most a partial last line, skipped when read), and what
`blockzoo plot` draws (docs/architecture.md, "Metrics file").

Keys: `step`, `tokens` (trained so far), `seconds` (since the start of this process's run), `loss`,
`learning_rate`, `gradient_norm`, `tokens_per_second`, `tflops`, `mfu` (when known), every named loss under its full
name (`decoder.3.mlp.load_balancing`, ...), and `evaluation_loss` at an evaluation step."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from blockzoo.training.tracking import Tracker, TrackerRun

METRICS_FILE = "metrics.jsonl"


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The entries of a metrics file, in order; an unreadable line (the partial last line of a killed run) skipped."""
    entries = []
    for line in Path(path).read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("step"), int):
            entries.append(entry)
    return entries


class MetricsFile:
    """Appends entries to `<output_dir>/metrics.jsonl`. A run that starts at `start_step` (0, or the step of the
    checkpoint it resumes from) first drops the entries of later steps: those of a run that went further than its
    last checkpoint, which this run trains again."""

    def __init__(self, output_dir: str | Path, *, start_step: int):
        self.path = Path(output_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            kept = [entry for entry in read_metrics(self.path) if entry["step"] <= start_step]
            partial = self.path.with_name(self.path.name + ".partial")
            partial.write_text("".join(json.dumps(entry) + "\n" for entry in kept))
            os.replace(partial, self.path)

    def write(self, entry: dict[str, Any]) -> None:
        with self.path.open("a") as file:
            file.write(json.dumps(entry) + "\n")


class JsonlTracker(Tracker):
    """The core's tracker `jsonl`: the run's `metrics.jsonl` (`MetricsFile`), every entry as it is."""

    file: MetricsFile

    def start(self, run: TrackerRun) -> None:
        self.file = MetricsFile(run.output_dir, start_step=run.start_step)

    def log(self, step: int, entry: dict[str, Any]) -> None:
        self.file.write(entry)
