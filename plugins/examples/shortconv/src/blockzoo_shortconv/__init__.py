"""blockzoo-shortconv: A gated short causal-convolution mixer: depthwise convolution over each document, gated by silu. (type `shortconv.gated_conv`).

Its config is `blockzoo_shortconv.config`, the layer `blockzoo_shortconv.mixer`, the hooks `blockzoo_shortconv.plugin`.
"""

import importlib.metadata

# The installed distribution's version: pyproject.toml is its one source.
__version__ = importlib.metadata.version("blockzoo-shortconv")
