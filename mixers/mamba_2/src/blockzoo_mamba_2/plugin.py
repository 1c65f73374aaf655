"""blockzoo-mamba-2's hooks: the `mamba_2` mixer, its Hugging Face converter sections, and whether the GPU kernels are
there."""

from __future__ import annotations

from blockzoo.api import PluginInfo, hookimpl
from blockzoo_mamba_2.config import Mamba2Config


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo(
        capabilities=tuple(sorted(Mamba2Config.capabilities)),
        description="Mamba 2 (SSD) over packed documents, tensor-, sequence-tensor- and sequence-data-parallel, with "
        "a generation state; mamba_ssm's Triton SSD kernels on CUDA when installed",
    )


@hookimpl
def register_mixers(register) -> None:
    register("mamba_2", Mamba2Config, "blockzoo_mamba_2.mamba_2:Mamba2")


@hookimpl
def check_environment() -> list[str]:
    """On CUDA without mamba_ssm the scan runs on the much slower torch path: say so."""
    from blockzoo_ssm import missing_kernels_advice

    return missing_kernels_advice("blockzoo-mamba-2")


@hookimpl
def register_converters(register) -> None:
    from blockzoo_mamba_2.huggingface import register_sections  # torch-free, like every hook's imports

    register_sections(register)


@hookimpl
def register_presets(register) -> None:
    from blockzoo_mamba_2.presets import register_presets as register_all  # torch-free

    register_all(register)
