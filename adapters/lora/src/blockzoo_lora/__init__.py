"""blockzoo-lora: LoRA fine-tuning (`peft: {type: lora}`). Its config is `blockzoo_lora.config`, the adapter
`blockzoo_lora.lora`."""

from blockzoo_lora.config import LoraConfig

__all__ = ["LoraConfig"]
