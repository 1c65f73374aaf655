"""blockzoo's discrete Mamba 2 mixer (type `discrete_mamba_2`). Its config classes are exported here."""

import importlib.metadata

from blockzoo_discrete_mamba_2.config import DiscreteMamba2Config

# The installed distribution's version: pyproject.toml is its one source.
__version__ = importlib.metadata.version("blockzoo-discrete-mamba-2")

__all__ = ["DiscreteMamba2Config", "__version__"]
