"""Config of the MLflow tracker (`type: mlflow`). Imports neither torch nor mlflow."""

from __future__ import annotations

from blockzoo.api import TrackerConfig, at_least, configclass, field


@configclass
class MLflowTrackerConfig(TrackerConfig):
    """Every logged figure as an MLflow metric at its step, the run config as parameters, the end as the run's status.
    A resumed run continues the same MLflow run (its id is kept in `<output_dir>/trackers/<name>.json`), or a new one
    superseding it when an earlier process had sent steps past the checkpoint (docs/tracking.md)."""

    tracking_uri: str | None = field(
        None,
        doc="Where the runs go (`http://host:5000`, `sqlite:///path/mlflow.db`, `databricks`, ...); None: a SQLite "
        "store in the output directory, `sqlite:///<output_dir>/mlflow.db`.",
    )
    experiment: str = field("blockzoo", doc="The experiment the run belongs to (made if it does not exist).")
    run_name: str | None = field(None, doc="The MLflow run's name; None: the output directory's name.")
    flush_seconds: float = field(
        5.0,
        doc="Figures are sent in batches, at most this long after they were logged (and at the run's end): a call per "
        "logged step costs milliseconds of the training process's CPU. 0: every logged step at once.",
        validator=at_least(0),
    )
    separate_process: bool = field(
        True,
        doc="Run the tracker in a child process of its own (the default here): its library's work never holds the "
        "training loop's interpreter. false: on a thread of the training process.",
    )
