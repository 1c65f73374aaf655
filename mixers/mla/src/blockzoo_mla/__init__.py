"""blockzoo's multi-head latent attention mixer (type `mla`). Its config classes are exported here."""

import importlib.metadata

from blockzoo_mla.config import MLAConfig

# The installed distribution's version: pyproject.toml is its one source.
__version__ = importlib.metadata.version("blockzoo-mla")

__all__ = ["MLAConfig", "__version__"]
