"""blockzoo's multi-head latent attention mixer (type `mla`). Its config classes are exported here."""

from blockzoo_mla.config import MLAConfig

__version__ = "0.1.0"

__all__ = ["MLAConfig", "__version__"]
