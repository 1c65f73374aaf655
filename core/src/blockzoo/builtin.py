"""The core's own plugin: it registers the core's types through the same entry-point group as everyone."""

from __future__ import annotations

from blockzoo import data
from blockzoo.layers import config as layers
from blockzoo.model import config as model
from blockzoo.plugins import PluginInfo, hookimpl
from blockzoo.training import config as training
from blockzoo.training import tracking_config as tracking


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo(description="blockzoo's own blocks, block sequences, normalizations and initializations")


@hookimpl
def register_mixers(register) -> None:
    register("none", layers.NoMixerConfig)


@hookimpl
def register_mlps(register) -> None:
    register("none", layers.NoMLPConfig)


@hookimpl
def register_blocks(register) -> None:
    register("decoder", model.DecoderBlockConfig, "blockzoo.model.block:DecoderBlock")
    register("parallel", model.ParallelBlockConfig, "blockzoo.model.parallel_block:ParallelBlock")
    register("fixed", model.FixedBlockSequenceConfig)
    register("pattern", model.PatternBlockSequenceConfig)


@hookimpl
def register_converters(register) -> None:
    from blockzoo.model.native import NATIVE  # (torch-free until a checkpoint is read)

    register("blockzoo", NATIVE)  # blockzoo's own checkpoints: a format like every other


@hookimpl
def register_components(register) -> None:
    register("normal", layers.NormalInitializationConfig, "blockzoo.layers.initialization:initialize_normal")
    register("uniform", layers.UniformInitializationConfig, "blockzoo.layers.initialization:initialize_uniform")
    register("fill", layers.FillInitializationConfig, "blockzoo.layers.initialization:initialize_fill")
    register("none", layers.NoNormalizationConfig, "blockzoo.layers.normalization:Identity")
    register("rms_norm", layers.RMSNormalizationConfig, "blockzoo.layers.normalization:RMSNorm")
    register("layer_norm", layers.LayerNormalizationConfig, "blockzoo.layers.normalization:LayerNorm")
    register("adamw", training.AdamWConfig, "blockzoo.training.optimizer:AdamW")
    register("jsonl", tracking.JsonlTrackerConfig, "blockzoo.training.metrics:JsonlTracker")
    data.register(register)
