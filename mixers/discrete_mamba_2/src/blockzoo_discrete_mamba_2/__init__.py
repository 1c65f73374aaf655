"""blockzoo's discrete Mamba 2 mixer (type `discrete_mamba_2`). Its config classes are exported here."""

from blockzoo_discrete_mamba_2.config import DiscreteMamba2Config

__version__ = "0.1.0"

__all__ = ["DiscreteMamba2Config", "__version__"]
