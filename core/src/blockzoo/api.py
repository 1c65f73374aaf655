"""The public API for plugins: everything a plugin may import from blockzoo (see docs/plugins/api.md).

Names that need torch (layers, the distributed runtime) load on first access, so a plugin's config
module can `from blockzoo.api import MixerConfig, configclass, field` without importing torch.
"""

from __future__ import annotations

import warnings
from typing import Any

from blockzoo._lazy import lazy_attributes
from blockzoo.benchmarks.base import Benchmark, BenchmarkConfig, BenchmarkResult
from blockzoo.config import (
    Config,
    ConfigError,
    ConfigFieldError,
    PolymorphicConfig,
    at_least,
    check,
    configclass,
    field,
    greater_than,
    structure,
    to_dict,
)
from blockzoo.conversion import (
    CheckpointFormat,
    Computed,
    ComputedWeights,
    Concatenated,
    ConfigMapping,
    Constant,
    ConversionError,
    Fixed,
    FormatNames,
    Ignored,
    Nested,
    Origin,
    Part,
    Rename,
    Section,
    Weight,
    WeightMapping,
    format_activation,
)
from blockzoo.data.tokenizer import ByteTokenizer, FileTokenizer, Tokenizer
from blockzoo.distributed.config import DistributedConfig
from blockzoo.errors import UsageError
from blockzoo.layers.config import (
    ALL_CAPABILITIES,
    GENERATION_CACHE,
    ONES,
    SEQUENCE_DATA_PARALLEL,
    SEQUENCE_TENSOR_PARALLEL,
    TENSOR_PARALLEL,
    ZEROS,
    Activation,
    BiasConfig,
    FillInitializationConfig,
    InitializationConfig,
    LinearConfig,
    MixerConfig,
    MLPConfig,
    NormalInitializationConfig,
    NormalizationConfig,
    ParameterConfig,
    ResolvedParameter,
    UniformInitializationConfig,
    check_fused_biases,
    default_activation,
    scaled_lr,
)
from blockzoo.model.config import BlockConfig, BlockSequenceConfig
from blockzoo.plugins import PLUGIN_API, PluginInfo, get_registry, hookimpl
from blockzoo.presets import Preset
from blockzoo.training.tracking import RunStatus, Tracker, TrackerRun, TrackerRunFile, scalar_figures
from blockzoo.training.tracking_config import TrackerConfig

# Deprecated former name -> the name that replaced it (tied to no library): existing plugins still import it.
_FORMER_NAMES = {"HuggingFaceTokenizer": "FileTokenizer", "transformers_activation": "format_activation"}

# name -> module that defines it; imported on first access (these need torch).
_LAZY = {
    "ACTIVATIONS": "blockzoo.layers.activations",
    "IGNORE_INDEX": "blockzoo.layers.batch",
    "Batch": "blockzoo.layers.batch",
    "SequenceData": "blockzoo.layers.batch",
    "slice_batch": "blockzoo.layers.slices",
    "slice_ranges": "blockzoo.layers.slices",
    "Layer": "blockzoo.layers.base",
    "Mixer": "blockzoo.layers.base",
    "MLP": "blockzoo.layers.base",
    "build_part": "blockzoo.model.block",
    "TensorDim": "blockzoo.layers.dims",
    "CompositeTensorDim": "blockzoo.layers.dims",
    "ConcatenatedTensorDim": "blockzoo.layers.dims",
    "ParameterMeta": "blockzoo.layers.parameter",
    "create_parameter": "blockzoo.layers.parameter",
    "materialize": "blockzoo.layers.parameter",
    "Linear": "blockzoo.layers.linear",
    "linear_options": "blockzoo.layers.linear",
    "Distributed": "blockzoo.distributed.runtime",
    "copy_to_tensor_region": "blockzoo.distributed.ops",
    "reduce_from_tensor_region": "blockzoo.distributed.ops",
    "gather_tokens": "blockzoo.distributed.ops",
    "reduce_scatter_tokens": "blockzoo.distributed.ops",
    "check_parallel_match": "blockzoo.distributed.check",
    "gather_slices": "blockzoo.distributed.sequence",
    "gather_slices_detached": "blockzoo.distributed.sequence",
    "previous_slice": "blockzoo.distributed.sequence",
    "sum_over_slices": "blockzoo.distributed.sequence",
    "initial_state_over_ranks": "blockzoo.distributed.recurrence",
    "depend_on": "blockzoo.distributed.recurrence",
}

__all__ = [
    "Activation",
    "scaled_lr",
    "default_activation",
    "ALL_CAPABILITIES",
    "GENERATION_CACHE",
    "ONES",
    "PLUGIN_API",
    "SEQUENCE_DATA_PARALLEL",
    "SEQUENCE_TENSOR_PARALLEL",
    "TENSOR_PARALLEL",
    "ZEROS",
    "FillInitializationConfig",
    "NormalInitializationConfig",
    "UniformInitializationConfig",
    "UsageError",
    "BiasConfig",
    "BlockConfig",
    "BlockSequenceConfig",
    "Config",
    "get_registry",
    "ConfigError",
    "ConfigFieldError",
    "DistributedConfig",
    "InitializationConfig",
    "LinearConfig",
    "MLPConfig",
    "MixerConfig",
    "NormalizationConfig",
    "ParameterConfig",
    "PluginInfo",
    "PolymorphicConfig",
    "Preset",
    "ResolvedParameter",
    "at_least",
    "check",
    "check_fused_biases",
    "configclass",
    "field",
    "greater_than",
    "hookimpl",
    "structure",
    "to_dict",
    # Converter sections (blockzoo.conversion)
    "CheckpointFormat",
    "Computed",
    "ComputedWeights",
    "Concatenated",
    "ConfigMapping",
    "Constant",
    "ConversionError",
    "Fixed",
    "Ignored",
    "Nested",
    "Origin",
    "Part",
    "Rename",
    "Section",
    "Weight",
    "WeightMapping",
    "format_activation",
    "FormatNames",
    # Benchmark backends (blockzoo.benchmarks.base) and the tokenizers they are given (blockzoo.data.tokenizer)
    "Benchmark",
    "BenchmarkConfig",
    "BenchmarkResult",
    "ByteTokenizer",
    "FileTokenizer",
    "Tokenizer",
    # Trackers (blockzoo.training.tracking)
    "RunStatus",
    "Tracker",
    "TrackerConfig",
    "TrackerRun",
    "TrackerRunFile",
    "scalar_figures",
    *_FORMER_NAMES,
    *_LAZY,
]

_lazy_attribute = lazy_attributes(globals(), _LAZY, keep=True)


def __getattr__(name: str) -> Any:
    if name in _FORMER_NAMES:
        current = _FORMER_NAMES[name]
        warnings.warn(f"blockzoo.api.{name} is deprecated: use {current}", DeprecationWarning, stacklevel=2)
        return globals()[current]
    return _lazy_attribute(name)
