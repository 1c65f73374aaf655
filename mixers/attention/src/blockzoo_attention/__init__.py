"""blockzoo's attention mixer (type `attention`) and its rotary embeddings (kind `rotary`).

Its config classes are exported here."""

import importlib.metadata

from blockzoo_attention.config import (
    AttentionConfig,
    DefaultRotaryConfig,
    Llama3RotaryConfig,
    NoRotaryConfig,
    PartialRotaryConfig,
    YarnRotaryConfig,
)

# The installed distribution's version: pyproject.toml is its one source.
__version__ = importlib.metadata.version("blockzoo-attention")

__all__ = [
    "AttentionConfig",
    "DefaultRotaryConfig",
    "Llama3RotaryConfig",
    "NoRotaryConfig",
    "PartialRotaryConfig",
    "YarnRotaryConfig",
    "__version__",
]
