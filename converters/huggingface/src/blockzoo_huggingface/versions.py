"""The two forms of a Hugging Face config: transformers 4.x (`rope_theta`, `rope_scaling`, `torch_dtype`) and 5.x
(`rope_parameters`, `dtype`). The sections read and write the 5.x form only; these functions turn a 4.x config into
it on import (as transformers 5 itself does) and back when writing for an installed 4.x."""

from __future__ import annotations

import importlib.metadata
from typing import Any

from packaging.version import InvalidVersion, Version

# Rope types whose `original_max_position_embeddings` defaults to `max_position_embeddings` (transformers does so).
_SCALED_ROPE_TYPES = ("llama3", "yarn", "longrope")


def installed_transformers() -> Version | None:
    """The installed transformers version, found without importing it (None if not installed)."""
    try:
        return Version(importlib.metadata.version("transformers"))
    except (importlib.metadata.PackageNotFoundError, InvalidVersion):
        return None


def target_version(version: str | Version | None) -> Version:
    """The transformers version to write for: the one given, else the installed one, else 5."""
    if version is not None:
        return Version(str(version))
    return installed_transformers() or Version("5.0")


def standardize(config: dict[str, Any], default_rope_theta: float | None) -> dict[str, Any]:
    """The 5.x form of a config of either version. `default_rope_theta`: the model's default (None: no RoPE)."""
    config = dict(config)
    legacy_theta = config.pop("rope_theta", None)
    legacy_scaling = config.pop("rope_scaling", None)
    partial_rotary_factor = config.pop("partial_rotary_factor", None)
    if "torch_dtype" in config:
        config.setdefault("dtype", config.pop("torch_dtype"))
    rope = config.get("rope_parameters") or legacy_scaling
    if rope is None and legacy_theta is None and default_rope_theta is None:
        return config
    rope = dict(rope or {})
    if "type" in rope:  # the oldest name of rope_type
        rope.setdefault("rope_type", rope.pop("type"))
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", legacy_theta if legacy_theta is not None else default_rope_theta)
    if partial_rotary_factor is not None:
        rope.setdefault("partial_rotary_factor", partial_rotary_factor)
    if rope["rope_type"] in _SCALED_ROPE_TYPES and "max_position_embeddings" in config:
        rope.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    config["rope_parameters"] = rope
    return config


def legacy(config: dict[str, Any]) -> dict[str, Any]:
    """The 4.x form of a 5.x config: `rope_theta` and `rope_scaling` (None for plain RoPE), `torch_dtype`."""
    config = dict(config)
    if "dtype" in config:
        config["torch_dtype"] = config.pop("dtype")
    rope = config.pop("rope_parameters", None)
    if rope is not None:
        rope = dict(rope)
        config["rope_theta"] = rope.pop("rope_theta")
        config["rope_scaling"] = None if rope.get("rope_type") == "default" and len(rope) == 1 else rope
    return config
