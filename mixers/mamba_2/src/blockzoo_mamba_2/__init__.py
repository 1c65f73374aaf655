"""blockzoo's Mamba 2 (SSD) mixer (type `mamba_2`). Its config classes are exported here."""

from blockzoo_mamba_2.config import Mamba2Config

__version__ = "0.1.0"

__all__ = ["Mamba2Config", "__version__"]
