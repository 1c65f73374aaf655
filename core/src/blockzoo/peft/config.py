"""Configs of the fine-tuning methods (`model.peft`): a polymorphic kind, `peft`, that plugins may extend. Torch-free.

A method's implementation (registered with its config) is a module class made as `implementation(config, linear,
distributed)` for each linear whose resolved `apply_peft` is true; see `blockzoo.peft.apply`. Every method is a
plugin's; one config that used to live here is still importable from here (below).
"""

from __future__ import annotations

from typing import ClassVar

from blockzoo.config import PolymorphicConfig, configclass


@configclass
class PeftConfig(PolymorphicConfig):
    """A parameter-efficient fine-tuning method. Kind `peft`; the `type` key is required."""

    kind: ClassVar[str] = "peft"
    default_type: ClassVar[str | None] = None


def __getattr__(name: str):
    # A thin re-export for existing users' code: LoRA's config moved to the blockzoo-lora distribution.
    if name == "LoraConfig":
        try:
            from blockzoo_lora.config import LoraConfig
        except ImportError:
            raise ImportError("LoraConfig is blockzoo-lora's: pip install blockzoo-lora") from None
        return LoraConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
