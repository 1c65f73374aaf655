"""The plugin's hooks: the Hugging Face formats, and the sections of the core's config classes in each."""

from __future__ import annotations

from blockzoo.api import PluginInfo, hookimpl


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo(description="Hugging Face checkpoints: import, export and convert (llama, mistral, qwen2, ...)")


@hookimpl
def register_converters(register) -> None:
    from blockzoo_huggingface.formats import FORMATS

    for checkpoint_format in FORMATS:
        register(checkpoint_format.name, checkpoint_format)
        for section in checkpoint_format.core_sections:
            register(checkpoint_format.name, section)


@hookimpl
def register_presets(register) -> None:
    from blockzoo_huggingface.presets import register_presets as register_all  # torch-free

    register_all(register)
