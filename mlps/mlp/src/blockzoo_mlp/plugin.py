"""The plugin's hooks: registers the dense MLP as MLP type `mlp`."""

from blockzoo.api import PluginInfo, hookimpl
from blockzoo_mlp.config import DenseMLPConfig


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo(
        capabilities=tuple(sorted(DenseMLPConfig.capabilities)),
        description="the dense MLP (gated or not, fused gate‖up, tensor-parallel)",
    )


@hookimpl
def register_mlps(register) -> None:
    register("mlp", DenseMLPConfig, "blockzoo_mlp.mlp:DenseMLP")


@hookimpl
def register_converters(register) -> None:
    from blockzoo_mlp.huggingface import register_sections  # torch-free, like every hook's imports

    register_sections(register)
