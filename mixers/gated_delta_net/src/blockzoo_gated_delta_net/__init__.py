"""blockzoo's Gated DeltaNet mixer (type `gated_delta_net`)."""

__version__ = "0.1.0"
