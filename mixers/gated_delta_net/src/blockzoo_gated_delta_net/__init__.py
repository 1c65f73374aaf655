"""blockzoo's Gated DeltaNet mixer (type `gated_delta_net`). Its config classes are exported here."""

import importlib.metadata

from blockzoo_gated_delta_net.config import GatedDeltaNetConfig

# The installed distribution's version: pyproject.toml is its one source.
__version__ = importlib.metadata.version("blockzoo-gated-delta-net")

__all__ = ["GatedDeltaNetConfig", "__version__"]
