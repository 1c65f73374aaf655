"""blockzoo's Mamba 2 (SSD) mixer (type `mamba_2`). Its config classes are exported here."""

import importlib.metadata

from blockzoo_mamba_2.config import Mamba2Config

# The installed distribution's version: pyproject.toml is its one source.
__version__ = importlib.metadata.version("blockzoo-mamba-2")

__all__ = ["Mamba2Config", "__version__"]
