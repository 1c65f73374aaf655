"""The MLflow tracker, through `mlflow.MlflowClient` (no global active run: several trackers and runs in one process
do not interfere).

A resumed run continues the MLflow run of the run's record (`TrackerRunFile`), unless an earlier process sent it steps
past the checkpoint the run resumes from: MLflow keeps every metric point it was sent and has no API to delete one, so
the resumed run's figures of those steps would sit beside the old ones. The tracker then makes a new MLflow run (same
name and parameters), copies into it the old run's points up to the checkpoint, tags both
(`blockzoo.supersedes` / `blockzoo.superseded_by`), ends the old one as KILLED and deletes it (MLflow's soft delete:
hidden from the experiment's runs, `mlflow runs restore` brings it back), and goes on in the new one: it holds every
step once, with the resumed run's figures."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from blockzoo.api import RunStatus, Tracker, TrackerRun, TrackerRunFile, scalar_figures

STATUSES = {"finished": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}
PARAMS_PER_CALL = 100  # MLflow's limit of parameters in one log_batch
PARAM_LENGTH = 6000  # MLflow's limit of a parameter's value
METRICS_PER_CALL = 1000  # MLflow's limit of metrics in one log_batch


class MLflowTracker(Tracker):
    def start(self, run: TrackerRun) -> None:
        try:
            from mlflow import MlflowClient
        except ImportError as error:
            raise ImportError(f"the mlflow tracker needs mlflow: pip install mlflow ({error})") from None
        uri = self.config.tracking_uri or f"sqlite:///{(run.output_dir / 'mlflow.db').resolve()}"
        run.output_dir.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=uri)
        self.record = TrackerRunFile.of(run)
        self.run_id = self._continued_run(run) if self.record.run_id else None
        if self.run_id is None:
            self.run_id = self._new_run(run)
        self.last_step = max(self.record.last_step, self._last_logged_step())
        if self.last_step > run.start_step:  # an earlier process went past the checkpoint
            self._supersede(run)
        self.pending: list[Any] = []  # metrics not sent yet (see `log`)
        self.sent_at = time.monotonic()

    def _new_run(self, run: TrackerRun) -> str:
        from mlflow.entities import Param

        experiment = self.client.get_experiment_by_name(self.config.experiment)
        if experiment is None:
            experiment_id = self.client.create_experiment(self.config.experiment)
        else:
            experiment_id = experiment.experiment_id
        created = self.client.create_run(experiment_id, run_name=self.config.run_name or run.output_dir.name)
        run_id = created.info.run_id
        self.record.update(run_id=run_id, last_step=0)
        params = {**_flat(run.config), **{f"parameters/{k}": v["parameters"] for k, v in run.parameters.items()}}
        items = [Param(key, str(value)[:PARAM_LENGTH]) for key, value in params.items()]
        for start in range(0, len(items), PARAMS_PER_CALL):
            self.client.log_batch(run_id, params=items[start : start + PARAMS_PER_CALL])
        return run_id

    def _continued_run(self, run: TrackerRun) -> str | None:
        """The MLflow run an earlier process of this run made (None if its store no longer has it), running again."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(self.record.run_id)
        except MlflowException:
            return None
        self.client.update_run(self.record.run_id, status="RUNNING")
        self.client.set_tag(self.record.run_id, "blockzoo.resumed_at_step", str(run.start_step))
        return self.record.run_id

    def _points(self, run_id: str) -> list[Any]:
        """Every metric point the MLflow run `run_id` holds."""
        keys = self.client.get_run(run_id).data.metrics
        return [point for key in keys for point in self.client.get_metric_history(run_id, key)]

    def _last_logged_step(self) -> int:
        """The last step of any metric the MLflow run holds (an earlier process may have sent a step it did not
        record)."""
        return max((point.step for point in self._points(self.run_id)), default=0)

    def _supersede(self, run: TrackerRun) -> None:
        """A new MLflow run in place of this one, holding its points up to `run.start_step` (module docstring)."""
        old = self.run_id
        kept = [point for point in self._points(old) if point.step <= run.start_step]
        self.run_id = self._new_run(run)
        self.record.update(superseded=[*self.record.data.get("superseded", []), old])
        for start in range(0, len(kept), METRICS_PER_CALL):
            self.client.log_batch(self.run_id, metrics=kept[start : start + METRICS_PER_CALL])
        self.client.set_tag(self.run_id, "blockzoo.supersedes", old)
        self.client.set_tag(self.run_id, "blockzoo.resumed_at_step", str(run.start_step))
        self.client.set_tag(old, "blockzoo.superseded_by", self.run_id)
        self.client.set_terminated(old, "KILLED")
        self.client.delete_run(old)
        self.last_step = run.start_step
        self.record.update(last_step=self.last_step)

    def log(self, step: int, entry: Mapping[str, Any]) -> None:
        # Steps the MLflow run already holds (an earlier process sent them, up to the checkpoint) are not sent again.
        if step <= self.last_step:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.pending += [Metric(name, float(value), now, step) for name, value in scalar_figures(entry).items()]
        self.last_step = step
        # One call per step costs several ms of this process's CPU (a database transaction each): the figures are
        # sent in batches, at most `flush_seconds` after they were logged, and at the end.
        if time.monotonic() - self.sent_at >= self.config.flush_seconds:
            self._send()

    def _send(self) -> None:
        for start in range(0, len(self.pending), METRICS_PER_CALL):
            self.client.log_batch(self.run_id, metrics=self.pending[start : start + METRICS_PER_CALL])
        if self.pending:
            self.record.update(last_step=self.pending[-1].step)
        self.pending, self.sent_at = [], time.monotonic()

    def finish(self, status: RunStatus) -> None:
        self._send()
        if status.message:
            self.client.set_tag(self.run_id, "blockzoo.status", status.message[:PARAM_LENGTH])
        self.client.set_terminated(self.run_id, STATUSES[status.state])


def _flat(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"model": {"hidden_size": 16}}` -> `{"model.hidden_size": 16}`; lists kept whole."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
