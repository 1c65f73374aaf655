"""blockzoo's Gated DeltaNet mixer (type `gated_delta_net`). Its config classes are exported here."""

from blockzoo_gated_delta_net.config import GatedDeltaNetConfig

__version__ = "0.1.0"

__all__ = ["GatedDeltaNetConfig", "__version__"]
