"""blockzoo's discrete Mamba 2 mixer (type `discrete_mamba_2`)."""

__version__ = "0.1.0"
