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
    """On a CUDA machine without mamba_ssm the scan still runs, on the much slower torch path: say so."""
    import torch

    from blockzoo.ssm import mamba_ssm_available

    if torch.cuda.is_available() and not mamba_ssm_available():
        return [
            "CUDA is available but mamba_ssm is not importable: the SSD scan takes the slow torch path "
            "(install the `kernels` extra: pip install 'blockzoo-mamba-2[kernels]')"
        ]
    return []


@hookimpl
def register_converters(register) -> None:
    from blockzoo_mamba_2.huggingface import register_sections  # torch-free, like every hook's imports

    register_sections(register)


@hookimpl
def register_presets(register) -> None:
    from blockzoo_mamba_2.presets import register_presets as register_all  # torch-free

    register_all(register)
