"""The plugin's hooks: registers tracker type `wandb`."""

from blockzoo.api import PluginInfo, hookimpl
from blockzoo_wandb.config import WandbTrackerConfig


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo(description="Weights & Biases tracker: a run's figures as a W&B run")


@hookimpl
def register_components(register) -> None:
    register("wandb", WandbTrackerConfig, "blockzoo_wandb.tracker:WandbTracker")
