"""Training data: packed-document datasets (kind `dataset`), the tokenizers, and `blockzoo prepare`.

Torch-free to import: the configs live in `blockzoo.data.config`; the datasets (`blockzoo.data.dataset`,
`memmap`, `embedded`, `synthetic`) import torch and are loaded when built.
"""

from __future__ import annotations

from collections.abc import Callable

from blockzoo._lazy import lazy_attributes
from blockzoo.data import formats
from blockzoo.data.config import (
    BlendedDatasetConfig,
    DatasetConfig,
    EmbeddedDatasetConfig,
    MemmapDatasetConfig,
    RandomDatasetConfig,
)

# name -> module that defines it; imported on first access (these need torch, or read files).
_LAZY = {
    "IGNORE_INDEX": "blockzoo.layers.base",
    "Dataset": "blockzoo.data.dataset",
    "MicroBatch": "blockzoo.data.dataset",
    "build_dataset": "blockzoo.data.dataset",
    "Tokenizer": "blockzoo.data.tokenizer",
    "load_tokenizer": "blockzoo.data.tokenizer",
}

__all__ = [
    "BlendedDatasetConfig",
    "DatasetConfig",
    "EmbeddedDatasetConfig",
    "MemmapDatasetConfig",
    "RandomDatasetConfig",
    "register",
    *_LAZY,
]


__getattr__ = lazy_attributes(globals(), _LAZY)


def register(register: Callable) -> None:
    """Register the dataset types; called from the core plugin's `register_components` hook."""
    register("memmap", MemmapDatasetConfig, "blockzoo.data.memmap:MemmapDataset")
    register("embedded", EmbeddedDatasetConfig, "blockzoo.data.embedded:EmbeddedDataset")
    register("random", RandomDatasetConfig, "blockzoo.data.synthetic:RandomDataset")
    register("blended", BlendedDatasetConfig, "blockzoo.data.blended:BlendedDataset")
    # `blockzoo prepare`'s input formats that need no library (blockzoo-corpora registers the others).
    register("text", formats.TextFormatConfig, "blockzoo.data.readers:TextFormat")
    register("paragraphs", formats.ParagraphsFormatConfig, "blockzoo.data.readers:ParagraphsFormat")
    register("jsonl", formats.JsonlFormatConfig, "blockzoo.data.readers:JsonlFormat")
    register("gz", formats.GzipCompressionConfig, "blockzoo.data.formats:open_gzip")
