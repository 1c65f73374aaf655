"""The Weights & Biases tracker, through the run object `wandb.init` returns (`reinit="create_new"`: never the global
run, so it neither takes over nor ends a run the user's own code holds)."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from blockzoo.api import RunStatus, Tracker, TrackerRun, TrackerRunFile, scalar_figures


class WandbTracker(Tracker):
    def start(self, run: TrackerRun) -> None:
        try:
            import wandb
        except ImportError as error:
            raise ImportError(f"the wandb tracker needs wandb: pip install wandb ({error})") from None
        self.record = TrackerRunFile.of(run)
        run_id = self.record.run_id or secrets.token_hex(4)  # W&B ids: up to 64 of [a-z0-9_-]
        directory = Path(self.config.dir) if self.config.dir else run.output_dir
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=self.config.project,
            entity=self.config.entity,
            name=self.config.name or run.output_dir.name,
            group=self.config.group,
            tags=list(self.config.tags),
            mode=self.config.mode,
            dir=str(directory),
            id=run_id,
            resume="allow",
            reinit="create_new",
            settings=wandb.Settings(console="off", silent=True),
        )
        # A resumed run may have changed its config (a longer train_iters): the W&B run's config follows.
        self.run.config.update({**run.config, "parameters": run.parameters}, allow_val_change=True)
        self.record.update(run_id=run_id)
        self.last_step = self.record.last_step

    def log(self, step: int, entry: Mapping[str, Any]) -> None:
        # A W&B run's history only moves forward (online, wandb drops a step at or below its last one; offline, each
        # process writes its own file): the steps an earlier process already sent are not sent again.
        if step <= self.last_step:
            return
        self.run.log(scalar_figures(entry), step=step)
        self.last_step = step
        self.record.update(last_step=step)

    def finish(self, status: RunStatus) -> None:
        self.run.summary["status"] = status.state
        if status.message:
            self.run.summary["status_message"] = status.message
        self.run.finish(exit_code=1 if status.state == "failed" else 0)
