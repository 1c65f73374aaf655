"""What the Hugging Face formats with Mamba 2 layers share (mamba2, bamba, nemotron_h, granitemoehybrid, falcon_h1):
the sections of a layer without mixer or MLP, transformers 4.x's untagged floats, the Mamba 2 inner size checked
against `expand` · hidden size, and the check of each layer's mixer and MLP types. Torch-free."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from blockzoo.api import get_registry
from blockzoo.conversion import Computed, ConfigMapping, ConversionError, Section
from blockzoo.layers.config import NoMixerConfig, NoMLPConfig
from blockzoo.model.config import ModelConfig
from blockzoo_huggingface.layouts import Layer

# The sections of the `none` mixer and MLP (a layer without one): nothing to convert.
NO_PARTS = (Section(config_class=NoMixerConfig), Section(config_class=NoMLPConfig))

INFINITY = {"__float__": "Infinity"}  # how transformers 5 writes it in a config.json


def _untag_floats(value: Any) -> Any:
    """transformers 4.x reads a bare `Infinity` (what Python's json writes), not 5.x's tagged one."""
    if value == INFINITY:
        return float("inf")
    if isinstance(value, list):
        return [_untag_floats(item) for item in value]
    if isinstance(value, dict):
        return {key: _untag_floats(item) for key, item in value.items()}
    return value


def _mamba_2_mixers(model: ModelConfig) -> list[Any]:
    return [
        block.mixer
        for _, block in model.decoder.expanded_blocks()
        if get_registry().name_of(type(block.mixer)) == "mamba_2"
    ]


def inner_size(expand: str, heads: str, head_size: str) -> ConfigMapping:
    """`expand`: transformers makes the Mamba 2 inner size expand · hidden_size and requires heads · head_size to be
    it; blockzoo's is heads · head_size, so export needs a multiple of the hidden size."""

    def import_(data: Mapping[str, Any]) -> dict[str, Any]:
        size, count, factor = data.get(head_size), data.get(heads), data.get(expand)
        if not all(isinstance(value, int) for value in (size, count, factor)):
            return {}  # missing (the sections say so) or Bamba's "auto" head size, which fits by construction
        if count * size != factor * data["hidden_size"]:
            raise ConversionError(
                f"`{heads}` · `{head_size}` ({count} · {size}) must equal `{expand}` · `hidden_size` "
                f"({factor} · {data['hidden_size']}), as transformers requires"
            )
        return {}

    def export(model: ModelConfig) -> dict[str, Any]:
        sizes = sorted({mixer.inner_size for mixer in _mamba_2_mixers(model)})
        if not sizes:
            return {}
        if len(sizes) > 1 or sizes[0] % model.hidden_size:
            raise ConversionError(
                f"Mamba 2 inner sizes (heads · head_size) {sizes} cannot be written: the format has one, "
                f"`{expand}` · hidden_size ({model.hidden_size})"
            )
        return {expand: sizes[0] // model.hidden_size}

    return Computed((), (expand,), import_=import_, export=export)


def _check_types(layers: Sequence[Layer], allowed: Sequence[Mapping[str, str]], format_name: str, hint: str) -> None:
    for index, layer in enumerate(layers):
        if dict(layer.types) not in allowed:
            raise ConversionError(
                f"decoder.{index}: a block of mixer {layer.types['mixer']!r} and MLP {layer.types['mlp']!r} cannot be "
                f"written in the {format_name} format ({hint})"
            )
