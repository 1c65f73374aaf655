"""The TensorBoard tracker: `torch.utils.tensorboard`'s SummaryWriter (event files need the `tensorboard` package)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from blockzoo.api import RunStatus, Tracker, TrackerRun, scalar_figures


class TensorBoardTracker(Tracker):
    def start(self, run: TrackerRun) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ImportError(f"the tensorboard tracker needs tensorboard: pip install tensorboard ({error})") from None
        self.log_dir = Path(self.config.log_dir) if self.config.log_dir else run.output_dir / "tensorboard"
        # purge_step: TensorBoard hides the events of steps >= it from earlier files of this directory, those of a
        # process that went past the checkpoint this run resumes from (or of a run that had none).
        self.writer = SummaryWriter(
            str(self.log_dir), purge_step=run.start_step + 1, flush_secs=self.config.flush_seconds
        )
        self.writer.add_text("run/config", _code(yaml.safe_dump(run.config, sort_keys=False)), run.start_step)
        self.writer.add_text("run/parameters", _code(json.dumps(run.parameters, indent=2)), run.start_step)

    def log(self, step: int, entry: Mapping[str, Any]) -> None:
        for name, value in scalar_figures(entry).items():
            self.writer.add_scalar(name, value, step)

    def finish(self, status: RunStatus) -> None:
        message = f"{status.state} at step {status.step}" + (f": {status.message}" if status.message else "")
        self.writer.add_text("run/status", message, status.step)
        self.writer.close()


def _code(text: str) -> str:
    """Text shown as written (TensorBoard renders markdown): indented as a code block."""
    return "\n".join("    " + line for line in text.splitlines())
