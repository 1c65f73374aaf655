"""blockzoo-mamba's hooks: the `mamba` mixer (Mamba 1, selective scan)."""

from __future__ import annotations

from blockzoo.api import PluginInfo, hookimpl
from blockzoo_mamba.config import MambaConfig


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo(
        capabilities=tuple(sorted(MambaConfig.capabilities)),
        description="Mamba 1 (selective scan; mamba_ssm's layout or Apriel's grouped x/B) over packed documents, "
        "tensor-, sequence-tensor- and sequence-data-parallel, with a generation state; blockzoo's Triton scan on CUDA",
    )


@hookimpl
def register_mixers(register) -> None:
    register("mamba", MambaConfig, "blockzoo_mamba.mamba:Mamba")


@hookimpl
def register_converters(register) -> None:
    from blockzoo_mamba.huggingface import register_sections  # torch-free, like every hook's imports

    register_sections(register)


@hookimpl
def check_environment() -> list[str]:
    """On CUDA the selective scan runs blockzoo's Triton kernel: say so if triton cannot be imported."""
    import importlib.util

    import torch

    if torch.cuda.is_available() and importlib.util.find_spec("triton") is None:
        return ["CUDA is available but triton is not installed: the mamba mixer's selective scan needs it on CUDA"]
    return []
