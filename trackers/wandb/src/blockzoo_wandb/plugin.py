"""The plugin's hooks: registers tracker type `wandb`."""

import importlib.util

from blockzoo.api import PluginInfo, hookimpl
from blockzoo_wandb.config import WandbTrackerConfig


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo(description="Weights & Biases tracker: a run's figures as a W&B run")


@hookimpl
def register_components(register) -> None:
    register("wandb", WandbTrackerConfig, "blockzoo_wandb.tracker:WandbTracker")


@hookimpl
def check_environment() -> list[str]:
    # Found, not imported: `blockzoo plugins` stays fast; a run without it reports the tracker's failure.
    if importlib.util.find_spec("wandb") is None:
        return ["wandb is not installed: pip install wandb (runs train without this tracker)"]
    return []
