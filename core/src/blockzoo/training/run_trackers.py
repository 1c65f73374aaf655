"""A run's trackers (`training.trackers`, on rank 0): started knowing the run, told how it ended."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torch import nn

from blockzoo.config import to_dict
from blockzoo.plugins import get_registry
from blockzoo.run_config import RunConfig
from blockzoo.training.reporting import parameter_counts
from blockzoo.training.signals import TrainingError
from blockzoo.training.tracking import RunStatus, TrackerRun, Trackers, TrackingError
from blockzoo.training.tracking_config import active_trackers


def start_trackers(run_config: RunConfig, model: nn.Module, step: int, log: Callable[[str], None]) -> Trackers:
    """The run's trackers, told the run's config, parameters and start `step`."""
    counts = {
        label: {"parameters": size, "layers": layers} for label, (size, layers) in parameter_counts(model).items()
    }
    counts["total"] = {"parameters": sum(count["parameters"] for count in counts.values()), "layers": 0}
    config, output_dir, training = to_dict(run_config), Path(run_config.training.output_dir), run_config.training

    def run_for(name: str) -> TrackerRun:
        return TrackerRun(config=config, parameters=counts, output_dir=output_dir, start_step=step, name=name)

    configs = active_trackers(training.trackers)
    if list(configs) != ["jsonl"]:  # where the figures go, when it is not only metrics.jsonl
        registry = get_registry()
        named = [f"{name} ({registry.name_of(type(config))})" for name, config in configs.items()]
        log("trackers: " + ", ".join(named) + (" (required)" if training.trackers_required else ""))
    return Trackers(configs, run_for, required=training.trackers_required, report=log)


def finish_trackers(
    trackers: Trackers | None,
    status: RunStatus,
    seconds: float | None,
    failing: bool,
    log: Callable[[str], None],
) -> None:
    """Tell the trackers how the run ended (waiting for them up to `seconds`, default `tracking.FINISH_SECONDS`).
    While the run fails already (`failing`), a tracker's failure is only reported."""
    if trackers is None:
        return
    try:
        trackers.finish(status, seconds)
    except TrackingError as error:
        if not failing:
            raise TrainingError(str(error)) from None
        log(str(error))
