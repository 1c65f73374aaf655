"""blockzoo-gated-delta-net's hooks: the `gated_delta_net` mixer, its Hugging Face converter section, and whether
the GPU kernel is there."""

from __future__ import annotations

from blockzoo.api import PluginInfo, hookimpl
from blockzoo_gated_delta_net.config import GatedDeltaNetConfig


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo(
        capabilities=tuple(sorted(GatedDeltaNetConfig.capabilities)),
        description="Gated DeltaNet (Qwen3-Next's linear attention) over packed documents, tensor-, "
        "sequence-tensor- and sequence-data-parallel, with a generation state; on CUDA blockzoo's own Triton kernels "
        "or flash-linear-attention's when installed",
    )


@hookimpl
def register_mixers(register) -> None:
    register("gated_delta_net", GatedDeltaNetConfig, "blockzoo_gated_delta_net.gated_delta_net:GatedDeltaNet")


@hookimpl
def check_environment() -> list[str]:
    """On a CUDA machine without flash-linear-attention the delta rule still runs, on the slower torch path."""
    import torch

    from blockzoo_gated_delta_net.delta_rule import fla_available

    if torch.cuda.is_available() and not fla_available():
        return [
            "CUDA is available but flash-linear-attention (fla) is not importable: gated_delta_net takes the slow "
            "torch path (install the `kernels` extra: pip install 'blockzoo-gated-delta-net[kernels]')"
        ]
    return []


@hookimpl
def register_converters(register) -> None:
    from blockzoo_gated_delta_net.huggingface import register_sections  # torch-free, like every hook's imports

    register_sections(register)
