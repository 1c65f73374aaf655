"""blockzoo-mlp: the dense MLP (`type: mlp`). Its config is `blockzoo_mlp.config`, the layer `blockzoo_mlp.mlp`."""

from blockzoo_mlp.config import DenseMLPConfig

__all__ = ["DenseMLPConfig"]
