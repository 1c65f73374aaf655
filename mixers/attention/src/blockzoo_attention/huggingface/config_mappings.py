"""The generic config mappings of the attention sections: rotary embeddings ↔ `rope_parameters`, the biases, the
sliding window, and the features most formats lack (key multiplier, output gate). Torch-free."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from blockzoo.api import Computed, ConfigMapping, Constant, ConversionError, Rename, get_registry
from blockzoo_attention.config import AttentionConfig, PartialRotaryConfig

# ---------------------------------------------------------------------------------------------------------------------
# Rotary embeddings ↔ `rope_parameters`

# The keys each supported rope type may have (transformers names), and blockzoo's field for each.
_ROPE_FIELDS = {
    "default": {},
    "llama3": {
        "factor": "scale_factor",
        "low_freq_factor": "low_frequency_factor",
        "high_freq_factor": "high_frequency_factor",
        "original_max_position_embeddings": "original_context_length",
    },
    "yarn": {
        "factor": "scale_factor",
        "attention_factor": "attention_factor",
        "beta_fast": "beta_fast",
        "beta_slow": "beta_slow",
        "original_max_position_embeddings": "original_context_length",
    },
}
# Keys that are fine at these values (what blockzoo computes).
_ROPE_NEUTRAL = {"partial_rotary_factor": 1.0, "truncate": True}


def _import_rotary(data: Mapping[str, Any]) -> dict[str, Any]:
    rope = data.get("rope_parameters")
    if not isinstance(rope, Mapping):
        raise ConversionError("`rope_parameters` is missing: this format uses rotary embeddings")
    rope_type = rope.get("rope_type", "default")
    if rope_type not in _ROPE_FIELDS:
        raise ConversionError(
            f"`rope_parameters.rope_type` = {rope_type!r} is not supported (blockzoo has {', '.join(_ROPE_FIELDS)})"
        )
    fields = _ROPE_FIELDS[rope_type]
    for key, value in rope.items():
        if key in ("rope_type", "rope_theta") or key in fields or value is None:
            continue
        if key in _ROPE_NEUTRAL and value == _ROPE_NEUTRAL[key]:
            continue
        raise ConversionError(f"`rope_parameters.{key}` = {value!r} is not supported for rope_type {rope_type!r}")
    rotary = {"type": rope_type, "theta": float(rope["rope_theta"])}
    for key, field in fields.items():
        if rope.get(key) is not None:
            rotary[field] = rope[key]
    return {"rotary": rotary}


def _export_rotary(config: AttentionConfig) -> dict[str, Any]:
    rotary = config.rotary
    rope_type = get_registry().name_of(type(rotary))
    if rope_type not in _ROPE_FIELDS:
        raise ConversionError(f"`rotary` type {rope_type!r} cannot be written (only {', '.join(_ROPE_FIELDS)})")
    rope = {"rope_type": rope_type, "rope_theta": rotary.theta}
    for key, field in _ROPE_FIELDS[rope_type].items():
        if getattr(rotary, field) is not None:  # yarn's attention_factor None: the format's default, the same
            rope[key] = getattr(rotary, field)
    return {"rope_parameters": rope}


ROTARY = Computed(("rotary",), ("rope_parameters",), import_=_import_rotary, export=_export_rotary)


def _export_no_rotary(config: AttentionConfig) -> dict[str, Any]:
    if get_registry().name_of(type(config.rotary)) != "none":
        raise ConversionError("`rotary` cannot be written: this format's attention has no rotary embeddings")
    return {}


# Formats whose attention has no position embedding (Jamba).
NO_ROTARY = Computed(("rotary",), (), import_=lambda data: {"rotary": {"type": "none"}}, export=_export_no_rotary)


def partial_rotary(default_fraction: float) -> ConfigMapping:
    """RoPE of type default on part of each head, `rope_parameters.partial_rotary_factor` (`default_fraction` when
    absent): blockzoo's `partial` rotary, or `default` for the whole head."""

    def import_(data: Mapping[str, Any]) -> dict[str, Any]:
        rope = data.get("rope_parameters")
        if not isinstance(rope, Mapping):
            raise ConversionError("`rope_parameters` is missing: this format uses rotary embeddings")
        known = ("rope_type", "rope_theta", "partial_rotary_factor")
        if rope.get("rope_type", "default") != "default" or any(
            key not in known and value is not None for key, value in rope.items()
        ):
            raise ConversionError(
                f"`rope_parameters` = {dict(rope)} is not supported: this format's conversion has rope_type default "
                "with `rope_theta` and `partial_rotary_factor` only"
            )
        fraction = rope.get("partial_rotary_factor")
        fraction, theta = default_fraction if fraction is None else fraction, float(rope["rope_theta"])
        if fraction == 1:
            return {"rotary": {"type": "default", "theta": theta}}
        return {"rotary": {"type": "partial", "theta": theta, "fraction": fraction}}

    def export(config: AttentionConfig) -> dict[str, Any]:
        rotary = config.rotary
        rope_type = get_registry().name_of(type(rotary))
        if rope_type not in ("default", "partial"):
            raise ConversionError(f"`rotary` type {rope_type!r} cannot be written (only default and partial)")
        fraction = rotary.fraction if isinstance(rotary, PartialRotaryConfig) else 1.0
        rope = {"rope_type": "default", "rope_theta": rotary.theta, "partial_rotary_factor": fraction}
        return {"rope_parameters": rope}

    return Computed(("rotary",), ("rope_parameters",), import_=import_, export=export)


# ---------------------------------------------------------------------------------------------------------------------
# Biases

_BIAS_FIELDS = (
    "add_linear_biases",
    "query.bias.enabled",
    "key.bias.enabled",
    "value.bias.enabled",
    "dense.bias.enabled",
)


def _biases(config: AttentionConfig) -> dict[str, bool]:
    return {role: config.has_bias(getattr(config, role)) for role in ("query", "key", "value", "dense")}


def all_biases(theirs: str | None) -> ConfigMapping:
    """One flag for the biases of q, k, v and o (`attention_bias`), or none at all (`theirs` None)."""

    def import_(data: Mapping[str, Any]) -> dict[str, Any]:
        return {"add_linear_biases": bool(data.get(theirs, False))} if theirs else {}

    def export(config: AttentionConfig) -> dict[str, Any]:
        biases = _biases(config)
        if len(set(biases.values())) > 1 or (theirs is None and any(biases.values())):
            allowed = f"`{theirs}` sets q, k, v and o biases alike" if theirs else "attention has no biases"
            raise ConversionError(f"attention biases {biases} cannot be written: {allowed}")
        return {theirs: biases["query"]} if theirs else {}

    return Computed(_BIAS_FIELDS, (theirs,) if theirs else (), import_=import_, export=export)


def qkv_biases(theirs: str | None) -> ConfigMapping:
    """Biases on q, k and v (one flag `theirs`, default true; or always, `theirs` None) and never on o (Qwen2)."""

    def import_(data: Mapping[str, Any]) -> dict[str, Any]:
        enabled = bool(data.get(theirs, True)) if theirs else True
        return {f"{role}.bias.enabled": enabled for role in ("query", "key", "value")}

    def export(config: AttentionConfig) -> dict[str, Any]:
        biases = _biases(config)
        qkv = {biases["query"], biases["key"], biases["value"]}
        if len(qkv) > 1 or biases["dense"] or (theirs is None and not biases["query"]):
            allowed = (
                f"`{theirs}` sets the q, k and v biases, o has none" if theirs else "q, k and v have biases, o none"
            )
            raise ConversionError(f"attention biases {biases} cannot be written: {allowed}")
        return {theirs: biases["query"]} if theirs else {}

    return Computed(_BIAS_FIELDS, (theirs,) if theirs else (), import_=import_, export=export)


# ---------------------------------------------------------------------------------------------------------------------
# Windows


def sliding_window(default: int | None) -> ConfigMapping:
    """`sliding_window` (None: full attention); `default` when the key is absent."""
    return Rename("window_size", "sliding_window", default=default)


# ---------------------------------------------------------------------------------------------------------------------
# Features most formats lack

# Formats without a key multiplier (all but Falcon-H1's).
NO_KEY_MULTIPLIER = Constant("key_multiplier", 1.0)

# Formats without an output gate (all but Qwen3-Next's).
NO_OUTPUT_GATE = Constant("output_gate", None)
