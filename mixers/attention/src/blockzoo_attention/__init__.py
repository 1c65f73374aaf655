"""blockzoo's attention mixer (type `attention`) and its rotary embeddings (kind `rotary`).

Its config classes are exported here."""

from blockzoo_attention.config import (
    AttentionConfig,
    DefaultRotaryConfig,
    Llama3RotaryConfig,
    NoRotaryConfig,
    PartialRotaryConfig,
    YarnRotaryConfig,
)

__version__ = "0.1.0"

__all__ = [
    "AttentionConfig",
    "DefaultRotaryConfig",
    "Llama3RotaryConfig",
    "NoRotaryConfig",
    "PartialRotaryConfig",
    "YarnRotaryConfig",
    "__version__",
]
