"""blockzoo-shortconv: A gated short causal-convolution mixer: depthwise convolution over each document, gated by silu. (type `shortconv.gated_conv`).

Its config is `blockzoo_shortconv.config`, the layer `blockzoo_shortconv.mixer`, the hooks `blockzoo_shortconv.plugin`.
"""

__version__ = "0.1.0"
