"""The plugin's hooks: registers tracker type `mlflow`."""

from blockzoo.api import PluginInfo, hookimpl
from blockzoo_mlflow.config import MLflowTrackerConfig


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo(description="MLflow tracker: a run's figures as an MLflow run")


@hookimpl
def register_components(register) -> None:
    register("mlflow", MLflowTrackerConfig, "blockzoo_mlflow.tracker:MLflowTracker")
