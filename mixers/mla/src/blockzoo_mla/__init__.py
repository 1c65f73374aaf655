"""blockzoo's multi-head latent attention mixer (type `mla`)."""

__version__ = "0.1.0"
