"""The Weights & Biases tracker, through the run object `wandb.init` returns (`reinit="create_new"`: never the global
run, so it neither takes over nor ends a run the user's own code holds).

A resumed run continues the W&B run of the run's record (`TrackerRunFile`), unless an earlier process sent it steps
past the checkpoint the run resumes from: a W&B history only moves forward (online, wandb drops a step at or below the
run's last; offline, each process writes its own file, all uploaded into the one run; its rewind, `resume_from`, is
an online-only beta), so the resumed run's figures of those steps could not replace the old ones. The tracker then
starts a new W&B run (same name, its notes naming the run it supersedes), replays into it the steps up to the
checkpoint from `metrics.jsonl`, and goes on there: the new run holds every step once, with the resumed run's
figures."""

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
        history = run.history() if self.record.run_id and self.record.last_step > run.start_step else None
        superseded = None
        if history is None:  # a new run, or one with nothing past the checkpoint (or nothing to replay): continued
            run_id = self.record.run_id or _new_id()
        else:
            run_id = _new_id()
            superseded = self.record.supersede(run_id, step=0)
        directory = Path(self.config.dir) if self.config.dir else run.output_dir
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=self.config.project,
            entity=self.config.entity,
            name=self.config.name or run.output_dir.name,
            group=self.config.group,
            tags=list(self.config.tags),
            notes=None if superseded is None else _supersedes(superseded, run.start_step),
            mode=self.config.mode,
            dir=str(directory),
            id=run_id,
            resume="allow",
            reinit="create_new",
            settings=wandb.Settings(console="off", silent=True),
        )
        # A resumed run may have changed its config (a longer train_iters): the W&B run's config follows.
        self.run.config.update({**run.config, "parameters": run.parameters}, allow_val_change=True)
        self.last_step = 0 if history is not None else self.record.last_step
        for entry in history or ():
            self.run.log(scalar_figures(entry), step=entry["step"])
            self.last_step = entry["step"]
        self.record.update(run_id=run_id, last_step=self.last_step)

    def log(self, step: int, entry: Mapping[str, Any]) -> None:
        # Steps the W&B run already holds (an earlier process sent them, up to the checkpoint) are not sent again.
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


def _new_id() -> str:
    return secrets.token_hex(4)  # W&B ids: up to 64 of [a-z0-9_-]


def _supersedes(old: str, step: int) -> str:
    return (
        f"Supersedes W&B run {old}: this run resumed from the checkpoint of step {step}, after which {old} holds "
        "figures of a process that was stopped; steps up to the checkpoint are replayed from metrics.jsonl."
    )
