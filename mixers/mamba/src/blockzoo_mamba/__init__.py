"""blockzoo's Mamba 1 mixer (type `mamba`): the selective scan, in mamba_ssm's layout or Apriel's grouped x/B one."""

__version__ = "0.1.0"
