"""blockzoo-attention's hooks: the `attention` mixer and the rotary types (`none`, `default`, `llama3`, `yarn`,
`partial`)."""

from __future__ import annotations

from blockzoo.api import PluginInfo, hookimpl
from blockzoo_attention import config


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo(
        capabilities=tuple(sorted(config.AttentionConfig.capabilities)),
        description="attention (MHA/GQA/MQA) with rotary embeddings, windows, packed documents and a KV cache",
    )


@hookimpl
def register_mixers(register) -> None:
    register("attention", config.AttentionConfig, "blockzoo_attention.attention:Attention")


@hookimpl
def register_components(register) -> None:
    register("none", config.NoRotaryConfig)
    register("default", config.DefaultRotaryConfig, "blockzoo_attention.rotary:default_frequencies")
    register("llama3", config.Llama3RotaryConfig, "blockzoo_attention.rotary:llama3_frequencies")
    register("yarn", config.YarnRotaryConfig, "blockzoo_attention.rotary:yarn_frequencies")
    register("partial", config.PartialRotaryConfig, "blockzoo_attention.rotary:partial_frequencies")


@hookimpl
def register_converters(register) -> None:
    from blockzoo_attention.huggingface import register_sections  # torch-free, like every hook's imports

    register_sections(register)


@hookimpl
def register_presets(register) -> None:
    from blockzoo_attention.presets import register_presets as register_all  # torch-free

    register_all(register)
