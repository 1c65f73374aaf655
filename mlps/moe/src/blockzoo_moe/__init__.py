"""blockzoo-moe: the mixture-of-experts MLP (`type: moe`). Config: `blockzoo_moe.config`; layer: `blockzoo_moe.moe`."""

from blockzoo_moe.config import MoEMLPConfig

__all__ = ["MoEMLPConfig"]
