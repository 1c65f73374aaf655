"""blockzoo-shortconv's hooks: registers the mixer type `shortconv.gated_conv`.

blockzoo imports this module to list plugins and validate configs, so it imports no torch: the layer is named by a
"module:Class" string and imported only when a model is built.
"""

from blockzoo.api import PluginInfo, hookimpl

from blockzoo_shortconv.config import GatedConvolutionConfig


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo(
        # The plugin API this was written for (blockzoo.api.PLUGIN_API then): a blockzoo of another major, or of an
        # older minor, refuses to load the plugin (docs/plugins/api.md).
        api_version=(1, 3),
        capabilities=tuple(sorted(GatedConvolutionConfig.capabilities)),
        description="A gated short causal-convolution mixer: depthwise convolution over each document, gated by silu.",
    )


@hookimpl
def register_mixers(register) -> None:
    # Third-party types are `<plugin name>.<name>`, the plugin name being the entry point's.
    register("shortconv.gated_conv", GatedConvolutionConfig, "blockzoo_shortconv.mixer:GatedConvolution")
