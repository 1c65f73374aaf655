"""blockzoo's Mamba 1 mixer (type `mamba`): the selective scan, in mamba_ssm's layout or Apriel's grouped x/B one.

Its config classes are exported here."""

from blockzoo_mamba.config import MambaConfig

__version__ = "0.1.0"

__all__ = ["MambaConfig", "__version__"]
