"""The plugin's hooks: registers tracker type `tensorboard`."""

from blockzoo.api import PluginInfo, hookimpl
from blockzoo_tensorboard.config import TensorBoardTrackerConfig


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo(description="TensorBoard tracker: a run's figures as event files")


@hookimpl
def register_components(register) -> None:
    register("tensorboard", TensorBoardTrackerConfig, "blockzoo_tensorboard.tracker:TensorBoardTracker")
