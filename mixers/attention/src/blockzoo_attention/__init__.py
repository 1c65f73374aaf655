"""blockzoo's attention mixer (type `attention`) and its rotary embeddings (kind `rotary`)."""

__version__ = "0.1.0"
