"""blockzoo: a plugin-based model zoo for training language models assembled from blocks.

`import blockzoo` is cheap: it loads no plugin and no torch. Plugins load on first use, and the
Python API (`build`, `load`, `save`, `Trainer`) imports torch when first used. The configs a model and a run are
assembled from are here too (docs/python-api.md); each layer's config comes from its plugin
(`blockzoo_attention.AttentionConfig`, `blockzoo_mamba_2.Mamba2Config`, `blockzoo_mlp.DenseMLPConfig`, ...).
"""

import importlib.metadata

from blockzoo._lazy import lazy_attributes
from blockzoo.plugins import hookimpl

# The installed distribution's version: core/pyproject.toml is its one source.
__version__ = importlib.metadata.version("blockzoo")

_API = {
    "build": "blockzoo.python_api",
    "load": "blockzoo.python_api",
    "save": "blockzoo.python_api",
    "Trainer": "blockzoo.training.trainer",
    "RunConfig": "blockzoo.run_config",
    "ModelConfig": "blockzoo.model.config",
    "EmbeddingsConfig": "blockzoo.model.config",
    "HeadConfig": "blockzoo.model.config",
    "DecoderBlockConfig": "blockzoo.model.config",
    "ParallelBlockConfig": "blockzoo.model.config",
    "FixedBlockSequenceConfig": "blockzoo.model.config",
    "PatternBlockSequenceConfig": "blockzoo.model.config",
    "RMSNormalizationConfig": "blockzoo.layers.config",
    "LayerNormalizationConfig": "blockzoo.layers.config",
    "DistributedConfig": "blockzoo.distributed.config",
    "TrainingConfig": "blockzoo.training.config",
    "AdamWConfig": "blockzoo.training.config",
    "ScheduleConfig": "blockzoo.training.config",
    "EvaluationConfig": "blockzoo.training.config",
    "EmbeddedDatasetConfig": "blockzoo.data.config",
    "MemmapDatasetConfig": "blockzoo.data.config",
    "RandomDatasetConfig": "blockzoo.data.config",
}

__all__ = ["__version__", "hookimpl", *_API]


__getattr__ = lazy_attributes(globals(), _API)
