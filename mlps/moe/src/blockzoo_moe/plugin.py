"""The plugin's hooks: registers the mixture of experts as MLP type `moe`."""

from blockzoo.api import PluginInfo, hookimpl
from blockzoo_moe.config import MoEMLPConfig


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo(
        capabilities=tuple(sorted(MoEMLPConfig.capabilities)),
        description="the mixture-of-experts MLP (dropless top-k routing, shared experts, tensor- and expert-parallel "
        "experts)",
    )


@hookimpl
def register_mlps(register) -> None:
    register("moe", MoEMLPConfig, "blockzoo_moe.moe:MoEMLP")


@hookimpl
def register_converters(register) -> None:
    from blockzoo_moe.huggingface import register_sections  # torch-free, like every hook's imports

    register_sections(register)


@hookimpl
def register_presets(register) -> None:
    from blockzoo_moe.presets import register_presets as register_all  # torch-free

    register_all(register)
