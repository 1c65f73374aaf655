"""Layer layouts: which kind of block each Hugging Face layer is, and the config each layer's sections read.

A Hugging Face config describes its layers with per-format keys (`layer_types`, `mlp_only_layers`,
`decoder_sparse_step`, ...). A layout turns them into one `Layer` per layer, the types of the block's parts
(`{"mixer": "attention", "mlp": "moe"}`) and the config as that layer's sections see it (per-layer values put in
place, e.g. `sliding_window` None on full-attention layers), and back: from every layer's exported keys and part
types it writes the format's keys, refusing what the format cannot express. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import attrs

from blockzoo.conversion import ConversionError


@attrs.frozen
class Layer:
    """One layer: the registered type of each block part, and the config its sections read (or wrote)."""

    types: Mapping[str, str]
    config: Mapping[str, Any]


class Layout(Protocol):
    """What a format's layout does (`Uniform` and its subclasses; hybrid formats add their own)."""

    @property
    def claims(self) -> tuple[str, ...]:
        """The config keys the layout reads and writes."""

    def layers(self, config: Mapping[str, Any]) -> list[Layer]:
        """One `Layer` per layer of the (5.x-form) config."""

    def merge(self, layers: Sequence[Layer], format_name: str) -> dict[str, Any]:
        """The config keys of every layer's exported keys and part types; what the format cannot express raises
        `ConversionError`."""


def merge_layers(layers: Sequence[Layer], format_name: str) -> dict[str, Any]:
    """One config from every layer's keys: a key must have one value on every layer that writes it."""
    merged: dict[str, Any] = {}
    first: dict[str, int] = {}
    for index, layer in enumerate(layers):
        for key, value in layer.config.items():
            if key in merged and merged[key] != value:
                raise ConversionError(
                    f"decoder.{first[key]} and decoder.{index} need different `{key}` ({merged[key]!r} and "
                    f"{value!r}); the {format_name} format has one value for all layers"
                )
            merged.setdefault(key, value)
            first.setdefault(key, index)
    return merged


def _layer_count(config: Mapping[str, Any]) -> int:
    count = config.get("num_hidden_layers")
    if not isinstance(count, int) or count < 1:
        raise ConversionError(f"`num_hidden_layers` must be a positive integer, got {count!r}")
    return count


@attrs.frozen(kw_only=True)
class Uniform:
    """Every layer the same kind of block: a `mixer` and an `mlp` of fixed types."""

    mixer: str = "attention"
    mlp: str = "mlp"

    @property
    def claims(self) -> tuple[str, ...]:
        """The config keys the layout reads and writes."""
        return ("num_hidden_layers",)

    def layers(self, config: Mapping[str, Any]) -> list[Layer]:
        return [Layer({"mixer": self.mixer, "mlp": self.mlp}, config)] * _layer_count(config)

    def merge(self, layers: Sequence[Layer], format_name: str) -> dict[str, Any]:
        self._check_types(layers, format_name)
        return {**merge_layers(layers, format_name), "num_hidden_layers": len(layers)}

    def _mlp_types(self) -> tuple[str, ...]:
        return (self.mlp,)

    def _check_types(self, layers: Sequence[Layer], format_name: str) -> None:
        for index, layer in enumerate(layers):
            for part, types in {"mixer": (self.mixer,), "mlp": self._mlp_types()}.items():
                if layer.types[part] not in types:
                    raise ConversionError(
                        f"decoder.{index}.{part}: type {layer.types[part]!r} cannot be written in the {format_name} "
                        f"format (only {' or '.join(map(repr, types))})"
                    )


_WINDOW_KEYS = ("layer_types", "use_sliding_window", "sliding_window", "max_window_layers")


def read_windows(config: Mapping[str, Any], count: int, *, derive: bool) -> list[int | None]:
    """Each layer's sliding window (None: full attention), Qwen2-style. `layer_types` lists the sliding layers;
    without it (`derive`), layer i slides when i >= `max_window_layers`. Nothing slides without
    `use_sliding_window` (as in transformers)."""
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    if config.get("layer_types") is not None:
        layer_types = list(config["layer_types"])
        unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
        if len(layer_types) != count or unknown:
            raise ConversionError(
                f"`layer_types` must list {count} of sliding_attention / full_attention, got {layer_types}"
            )
        sliding = [layer_type == "sliding_attention" for layer_type in layer_types]
    elif window is None:
        sliding = [False] * count
    elif derive:
        sliding = [index >= config.get("max_window_layers", 28) for index in range(count)]
    else:  # transformers versions disagree on which layers slide without an explicit list
        raise ConversionError("`use_sliding_window` is set without `layer_types`: list the sliding layers")
    return [window if slides else None for slides in sliding]


def write_windows(windows: Sequence[int | None], format_name: str, *, derive: bool) -> dict[str, Any]:
    """The Qwen2-style keys for each layer's window (None: full attention). With `derive`, also
    `max_window_layers`, which says the same to readers without `layer_types` when the sliding layers are last."""
    sizes = sorted({window for window in windows if window is not None})
    if len(sizes) > 1:
        raise ConversionError(f"layers use sliding windows of {sizes} tokens; the {format_name} format has one")
    sliding = [window is not None for window in windows]
    keys = {
        "use_sliding_window": bool(sizes),
        "sliding_window": sizes[0] if sizes else None,
        "layer_types": ["sliding_attention" if slides else "full_attention" for slides in sliding],
    }
    if derive:
        first = sliding.index(True) if any(sliding) else len(windows)
        keys["max_window_layers"] = first if all(sliding[first:]) else len(windows)
    return keys


def _without_window(layer: Layer) -> Layer:
    return Layer(layer.types, {key: value for key, value in layer.config.items() if key != "sliding_window"})


@attrs.frozen(kw_only=True)
class SlidingWindowLayers(Uniform):
    """Qwen2: some layers slide (`read_windows`); each layer's sections read its own `sliding_window`."""

    @property
    def claims(self) -> tuple[str, ...]:
        return ("num_hidden_layers", *_WINDOW_KEYS)

    def layers(self, config: Mapping[str, Any]) -> list[Layer]:
        windows = read_windows(config, _layer_count(config), derive=True)
        return [Layer({"mixer": self.mixer, "mlp": self.mlp}, {**config, "sliding_window": w}) for w in windows]

    def merge(self, layers: Sequence[Layer], format_name: str) -> dict[str, Any]:
        windows = [layer.config.get("sliding_window") for layer in layers]
        merged = super().merge([_without_window(layer) for layer in layers], format_name)
        return {**merged, **write_windows(windows, format_name, derive=True)}


@attrs.frozen(kw_only=True)
class SparseMoELayers(Uniform):
    """Qwen-MoE: layer i has the MoE when i is not in `mlp_only_layers` and (i + 1) % `decoder_sparse_step` is 0,
    else a dense MLP. With `sliding_layers` (Qwen2-MoE), each layer's window as Qwen2, listed in `layer_types`
    (`max_window_layers` is not written: it counts only without `layer_types`)."""

    mlp: str = "moe"
    sliding_layers: bool = False

    @property
    def claims(self) -> tuple[str, ...]:
        windows = _WINDOW_KEYS if self.sliding_layers else ()
        return ("num_hidden_layers", "mlp_only_layers", "decoder_sparse_step", *windows)

    def _mlp_types(self) -> tuple[str, ...]:
        return ("moe", "mlp")

    def layers(self, config: Mapping[str, Any]) -> list[Layer]:
        count = _layer_count(config)
        dense = set(config.get("mlp_only_layers") or ())
        step = config.get("decoder_sparse_step", 1)
        if not isinstance(step, int) or step < 1:
            raise ConversionError(f"`decoder_sparse_step` must be a positive integer, got {step!r}")
        mlp = ["moe" if index not in dense and (index + 1) % step == 0 else "mlp" for index in range(count)]
        if not self.sliding_layers:
            return [Layer({"mixer": self.mixer, "mlp": kind}, config) for kind in mlp]
        windows = read_windows(config, count, derive=False)
        return [
            Layer({"mixer": self.mixer, "mlp": kind}, {**config, "sliding_window": window})
            for kind, window in zip(mlp, windows)
        ]

    def merge(self, layers: Sequence[Layer], format_name: str) -> dict[str, Any]:
        windows = [layer.config.get("sliding_window") for layer in layers]
        if self.sliding_layers:
            layers = [_without_window(layer) for layer in layers]
        merged = {
            **super().merge(layers, format_name),
            "decoder_sparse_step": 1,
            "mlp_only_layers": [index for index, layer in enumerate(layers) if layer.types["mlp"] == "mlp"],
        }
        if self.sliding_layers:
            merged.update(write_windows(windows, format_name, derive=False))
        return merged
