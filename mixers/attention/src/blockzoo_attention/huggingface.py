"""How attention is written in the Hugging Face formats (converter sections, see `blockzoo.conversion`).

The sections read the transformers 5 form of the config: the converter turns a 4.x config (`rope_theta`,
`rope_scaling`) into `rope_parameters` before they see it, and back when it writes for 4.x. Per-layer values
(Qwen2's sliding-window layers) are put in place by the converter's layer layout. Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from blockzoo.api import (
    Computed,
    Concatenated,
    ConfigMapping,
    Constant,
    ConversionError,
    Fixed,
    Ignored,
    Nested,
    Part,
    Rename,
    Section,
    Weight,
    WeightMapping,
    get_registry,
)
from blockzoo_attention.config import AttentionConfig

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


# Qwen3-MoE: `sliding_window` counts only with `use_sliding_window`, on every layer (transformers 5;
# `max_window_layers` is no longer read).
QWEN3_WINDOW = Computed(
    ("window_size",),
    ("use_sliding_window", "sliding_window", "max_window_layers"),
    import_=lambda data: {"window_size": data.get("sliding_window") if data.get("use_sliding_window") else None},
    export=lambda config: {"use_sliding_window": config.window_size is not None, "sliding_window": config.window_size},
)


# ---------------------------------------------------------------------------------------------------------------------
# The section


def _head_size(data: Mapping[str, Any]) -> dict[str, Any]:
    head_dim = data.get("head_dim")
    return {"head_size": head_dim if head_dim is not None else data["hidden_size"] // data["num_attention_heads"]}


def _softmax_scale(config: AttentionConfig) -> dict[str, Any]:
    if not math.isclose(config.resolved_softmax_scale, config.head_size**-0.5, rel_tol=1e-12):
        raise ConversionError(
            f"`softmax_scale` {config.softmax_scale} cannot be written: the format uses head_dim**-0.5"
        )
    return {}


def _weights(config: AttentionConfig) -> list[WeightMapping | Nested]:
    mappings: list[WeightMapping | Nested] = [
        Weight("query.weight", "q_proj.weight"),
        Concatenated("key_value.weight", ("k_proj.weight", "v_proj.weight")),
        Weight("dense.weight", "o_proj.weight"),
    ]
    if config.has_bias(config.query):
        mappings.append(Weight("query.bias", "q_proj.bias"))
    if config.has_bias(config.key):
        mappings.append(Concatenated("key_value.bias", ("k_proj.bias", "v_proj.bias")))
    if config.has_bias(config.dense):
        mappings.append(Weight("dense.bias", "o_proj.bias"))
    if config.query_norm is not None:
        mappings.append(Nested("query_norm", config.query_norm, "q_norm"))
    if config.key_norm is not None:
        mappings.append(Nested("key_norm", config.key_norm, "k_norm"))
    return mappings


def attention_section(*, biases: ConfigMapping, window: ConfigMapping, head_norms: bool = False) -> Section:
    """Llama-style attention (`self_attn.{q,k,v,o}_proj`), with the format's biases, window and head norms."""
    norms = (
        (Part("query_norm", type="rms_norm"), Part("key_norm", type="rms_norm"))
        if head_norms
        else (Constant("query_norm", None), Constant("key_norm", None))
    )
    return Section(
        config_class=AttentionConfig,
        name="self_attn",
        config=(
            Rename("heads", "num_attention_heads"),
            Computed(
                ("head_groups",),
                ("num_key_value_heads",),
                import_=lambda data: {"head_groups": data.get("num_key_value_heads") or data["num_attention_heads"]},
                export=lambda config: {"num_key_value_heads": config.resolved_head_groups},
            ),
            Computed(("head_size",), ("head_dim",), import_=_head_size, export=lambda c: {"head_dim": c.head_size}),
            biases,
            ROTARY,
            Constant("causal", True),
            window,
            Computed(("softmax_scale",), (), export=_softmax_scale),
            *(norm for norm in norms if isinstance(norm, ConfigMapping)),
            Fixed("attention_dropout", 0.0),
            Ignored(ours=("implementation",), reason="the kernel is chosen for the device, not stored"),
        ),
        parts=tuple(norm for norm in norms if isinstance(norm, Part)),
        weights=_weights,
    )


def register_sections(register: Callable[[str, Section], None]) -> None:
    """The attention section of every Hugging Face format with attention."""
    register("llama", attention_section(biases=all_biases("attention_bias"), window=Constant("window_size", None)))
    register("mistral", attention_section(biases=all_biases(None), window=sliding_window(default=4096)))
    register("mixtral", attention_section(biases=all_biases(None), window=sliding_window(default=None)))
    # Qwen2 and Qwen2-MoE: the converter's layout gives each layer its `sliding_window` (None where full).
    register("qwen2", attention_section(biases=qkv_biases(None), window=sliding_window(default=None)))
    register("qwen2_moe", attention_section(biases=qkv_biases("qkv_bias"), window=sliding_window(default=None)))
    register("qwen3_moe", attention_section(biases=all_biases("attention_bias"), window=QWEN3_WINDOW, head_norms=True))
