"""The plugin's hooks: registers tracker type `tensorboard`."""

import importlib.util

from blockzoo.api import PluginInfo, hookimpl
from blockzoo_tensorboard.config import TensorBoardTrackerConfig


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo(description="TensorBoard tracker: a run's figures as event files")


@hookimpl
def register_components(register) -> None:
    register("tensorboard", TensorBoardTrackerConfig, "blockzoo_tensorboard.tracker:TensorBoardTracker")


@hookimpl
def check_environment() -> list[str]:
    # Found, not imported: `blockzoo plugins` stays fast; a run without it reports the tracker's failure.
    if importlib.util.find_spec("tensorboard") is None:
        return ["tensorboard is not installed: pip install tensorboard (runs train without this tracker)"]
    return []
