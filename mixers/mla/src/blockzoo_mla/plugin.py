"""blockzoo-mla's hooks: the `mla` mixer (multi-head latent attention) and its Hugging Face converter section."""

from __future__ import annotations

from blockzoo.api import PluginInfo, hookimpl
from blockzoo_mla.config import MLAConfig


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo(
        capabilities=tuple(sorted(MLAConfig.capabilities)),
        description="multi-head latent attention (DeepSeek's MLA): low-rank query and key-value compression, "
        "packed documents, a latent KV cache with absorbed decoding",
    )


@hookimpl
def register_mixers(register) -> None:
    register("mla", MLAConfig, "blockzoo_mla.mla:MultiHeadLatentAttention")


@hookimpl
def register_converters(register) -> None:
    from blockzoo_mla.huggingface import register_sections  # torch-free, like every hook's imports

    register_sections(register)
