"""The plugin's hooks: registers tracker type `mlflow`."""

import importlib.util

from blockzoo.api import PluginInfo, hookimpl
from blockzoo_mlflow.config import MLflowTrackerConfig


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo(description="MLflow tracker: a run's figures as an MLflow run")


@hookimpl
def register_components(register) -> None:
    register("mlflow", MLflowTrackerConfig, "blockzoo_mlflow.tracker:MLflowTracker")


@hookimpl
def check_environment() -> list[str]:
    # Found, not imported: `blockzoo plugins` stays fast; a run without it reports the tracker's failure.
    if importlib.util.find_spec("mlflow") is None:
        return ["mlflow is not installed: pip install mlflow (runs train without this tracker)"]
    return []
