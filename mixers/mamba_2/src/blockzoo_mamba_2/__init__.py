"""blockzoo's Mamba 2 (SSD) mixer (type `mamba_2`)."""

__version__ = "0.1.0"
