"""blockzoo-discrete-mamba-2's hooks: the `discrete_mamba_2` mixer."""

from __future__ import annotations

from blockzoo.api import PluginInfo, hookimpl
from blockzoo_discrete_mamba_2 import config


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo(
        capabilities=tuple(sorted(config.DiscreteMamba2Config.capabilities)),
        description="discrete Mamba 2 (MOHAWK / Llamba / Apriel m2d) over packed documents, with a generation state",
    )


@hookimpl
def register_mixers(register) -> None:
    register("discrete_mamba_2", config.DiscreteMamba2Config, "blockzoo_discrete_mamba_2.mixer:DiscreteMamba2")


@hookimpl
def register_converters(register) -> None:
    from blockzoo_discrete_mamba_2.huggingface import register_sections  # torch-free, like every hook's imports

    register_sections(register)


@hookimpl
def check_environment() -> list[str]:
    """On CUDA without mamba_ssm the scan runs on the much slower torch path: say so."""
    from blockzoo_ssm import missing_kernels_advice

    return missing_kernels_advice("blockzoo-discrete-mamba-2")
