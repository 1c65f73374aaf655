"""The plugin's hooks: registers LoRA as PEFT type `lora`."""

from blockzoo.api import PluginInfo, hookimpl
from blockzoo_lora.config import LoraConfig


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo(description="LoRA fine-tuning: low-rank adapters on the linears that apply PEFT")


@hookimpl
def register_components(register) -> None:
    register("lora", LoraConfig, "blockzoo_lora.lora:LoraAdapter")
