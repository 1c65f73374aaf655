"""blockzoo's Mamba 1 mixer (type `mamba`): the selective scan, in mamba_ssm's layout or Apriel's grouped x/B one.

Its config classes are exported here."""

import importlib.metadata

from blockzoo_mamba.config import MambaConfig

# The installed distribution's version: pyproject.toml is its one source.
__version__ = importlib.metadata.version("blockzoo-mamba")

__all__ = ["MambaConfig", "__version__"]
