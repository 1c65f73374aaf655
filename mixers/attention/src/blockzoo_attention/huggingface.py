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
    ComputedWeights,
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


def _rotary_order(config: AttentionConfig) -> list[int] | None:
    """Partial rotary: blockzoo's channel c of a head is transformers' channel order[c] (None: the same channels).
    transformers rotates channels [0, r) in pairs (j, j + r/2) and passes [r, head_size) through; blockzoo pairs
    (i, i + head_size/2), the first r/2 turning: each half of a blockzoo head is half the turning channels, then
    half the others. The attention scores do not change when queries and keys are permuted alike."""
    if not isinstance(config.rotary, PartialRotaryConfig):
        return None
    size, turning = config.head_size, config.rotary.rotary_size(config.head_size)
    rest = (size - turning) // 2
    return [
        *range(turning // 2),
        *range(turning, turning + rest),
        *range(turning // 2, turning),
        *range(turning + rest, size),
    ]


def _reorder_heads(order: list[int], head_size: int) -> Callable[[Any], Any]:
    """Rows grouped by head (q_proj, k_proj, their biases) with each head's rows taken in `order`."""
    return lambda tensor: tensor.unflatten(0, (-1, head_size))[:, order].flatten(0, 1)


def _query(config: AttentionConfig, suffix: str) -> WeightMapping:
    order = _rotary_order(config)
    if order is None:
        return Weight(f"query.{suffix}", f"q_proj.{suffix}")
    to_ours, to_theirs = _reorder_heads(order, config.head_size), _reorder_heads(_inverse(order), config.head_size)
    return ComputedWeights(
        (f"query.{suffix}",),
        (f"q_proj.{suffix}",),
        import_=lambda tensors: [to_ours(tensors[0])],
        export=lambda tensors: [to_theirs(tensors[0])],
    )


def _key_value(config: AttentionConfig, suffix: str) -> WeightMapping:
    order = _rotary_order(config)
    if order is None:
        return Concatenated(f"key_value.{suffix}", (f"k_proj.{suffix}", f"v_proj.{suffix}"))
    to_ours, to_theirs = _reorder_heads(order, config.head_size), _reorder_heads(_inverse(order), config.head_size)

    def import_(tensors: list[Any]) -> list[Any]:
        import torch

        return [torch.cat([to_ours(tensors[0]), tensors[1]])]

    def export(tensors: list[Any]) -> list[Any]:
        key, value = tensors[0].chunk(2)
        return [to_theirs(key), value.contiguous()]

    return ComputedWeights(
        (f"key_value.{suffix}",), (f"k_proj.{suffix}", f"v_proj.{suffix}"), import_=import_, export=export
    )


def _gated_query(config: AttentionConfig, suffix: str) -> WeightMapping:
    """Qwen3-Next's gated attention: `q_proj` holds, head by head, the head's query rows then its gate rows."""
    size, order = config.head_size, _rotary_order(config)

    def import_(tensors: list[Any]) -> list[Any]:
        heads = tensors[0].unflatten(0, (-1, 2 * size))
        query, gate = heads[:, :size].flatten(0, 1), heads[:, size:].flatten(0, 1)
        return [query if order is None else _reorder_heads(order, size)(query), gate]

    def export(tensors: list[Any]) -> list[Any]:
        import torch

        query, gate = tensors
        query = query if order is None else _reorder_heads(_inverse(order), size)(query)
        return [torch.cat([query.unflatten(0, (-1, size)), gate.unflatten(0, (-1, size))], dim=1).flatten(0, 1)]

    return ComputedWeights(
        (f"query.{suffix}", f"output_gate.{suffix}"), (f"q_proj.{suffix}",), import_=import_, export=export
    )


def _inverse(order: list[int]) -> list[int]:
    inverse = [0] * len(order)
    for position, channel in enumerate(order):
        inverse[channel] = position
    return inverse


def _head_norm(config: AttentionConfig, role: str, theirs: str, offset: float | None) -> WeightMapping | Nested:
    """A head norm under `theirs`: by the format's norm section (Nested); or here, when a partial rotary reorders
    the head's channels (the norm's weight is reordered alike) or the format scales by (offset + w) (Qwen3-Next's
    (1 + w): blockzoo's weight is offset + w, computed in fp32)."""
    order = _rotary_order(config)
    if order is None and offset is None:
        return Nested(role, getattr(config, role), theirs)
    to_ours = (lambda tensor: tensor) if order is None else (lambda tensor: tensor[order])
    to_theirs = (lambda tensor: tensor) if order is None else (lambda tensor: tensor[_inverse(order)])
    shift = offset or 0.0
    return ComputedWeights(
        (f"{role}.weight",),
        (f"{theirs}.weight",),
        import_=lambda tensors: [to_ours(tensors[0].float().add(shift).to(tensors[0].dtype))],
        export=lambda tensors: [to_theirs(tensors[0]).float().sub(shift).to(tensors[0].dtype)],
    )


def _weights(config: AttentionConfig, norm_offset: float | None = None) -> list[WeightMapping | Nested]:
    query = _query if config.output_gate is None else _gated_query
    mappings: list[WeightMapping | Nested] = [
        query(config, "weight"),
        _key_value(config, "weight"),
        Weight("dense.weight", "o_proj.weight"),
    ]
    if config.has_bias(config.query):
        mappings.append(query(config, "bias"))
    if config.has_bias(config.key):
        mappings.append(_key_value(config, "bias"))
    if config.has_bias(config.dense):
        mappings.append(Weight("dense.bias", "o_proj.bias"))
    if config.query_norm is not None:
        mappings.append(_head_norm(config, "query_norm", "q_norm", norm_offset))
    if config.key_norm is not None:
        mappings.append(_head_norm(config, "key_norm", "k_norm", norm_offset))
    return mappings


# Formats without a key multiplier (all but Falcon-H1's).
NO_KEY_MULTIPLIER = Constant("key_multiplier", 1.0)

# Formats without an output gate (all but Qwen3-Next's).
NO_OUTPUT_GATE = Constant("output_gate", None)


def _export_output_gate(config: AttentionConfig) -> dict[str, Any]:
    if config.output_gate is None or config.has_bias(config.output_gate) != config.has_bias(config.query):
        raise ConversionError(
            "`output_gate` must be set, with a bias exactly when the query has one: Qwen3-Next's attention gates its "
            "output with rows of q_proj"
        )
    return {}


# Qwen3-Next: q_proj computes each head's query and output gate.
OUTPUT_GATE = Computed(("output_gate",), (), import_=lambda data: {"output_gate": {}}, export=_export_output_gate)


def attention_section(
    *,
    biases: ConfigMapping,
    window: ConfigMapping,
    head_norms: bool = False,
    rotary: ConfigMapping = ROTARY,
    name: str = "self_attn",
    output_gate: ConfigMapping = NO_OUTPUT_GATE,
    norm_offset: float | None = None,
    softmax_scale: ConfigMapping | None = None,
    head_size: ConfigMapping | None = None,
    key_multiplier: ConfigMapping = NO_KEY_MULTIPLIER,
    extra: tuple[ConfigMapping, ...] = (),
) -> Section:
    """Llama-style attention (`self_attn.{q,k,v,o}_proj`, or under `name`), with the format's biases, window, head
    norms and rotary embeddings (`NO_ROTARY`: none; `partial_rotary`), its softmax scale (None: head_dim**-0.5
    only), its head size (None: `head_dim`, else hidden / heads), its key multiplier (Falcon-H1's; else 1) and
    `extra` keys of its own."""
    norms = (
        (Part("query_norm", type="rms_norm"), Part("key_norm", type="rms_norm"))
        if head_norms
        else (Constant("query_norm", None), Constant("key_norm", None))
    )
    return Section(
        config_class=AttentionConfig,
        name=name,
        config=(
            Rename("heads", "num_attention_heads"),
            Computed(
                ("head_groups",),
                ("num_key_value_heads",),
                import_=lambda data: {"head_groups": data.get("num_key_value_heads") or data["num_attention_heads"]},
                export=lambda config: {"num_key_value_heads": config.resolved_head_groups},
            ),
            head_size
            or Computed(("head_size",), ("head_dim",), import_=_head_size, export=lambda c: {"head_dim": c.head_size}),
            biases,
            rotary,
            Constant("causal", True),
            window,
            softmax_scale or Computed(("softmax_scale",), (), export=_softmax_scale),
            key_multiplier,
            *(norm for norm in norms if isinstance(norm, ConfigMapping)),
            Fixed("attention_dropout", 0.0),
            Ignored(ours=("implementation",), reason="the kernel is chosen for the device, not stored"),
            output_gate,
            *extra,
        ),
        parts=tuple(norm for norm in norms if isinstance(norm, Part)),
        weights=lambda config: _weights(config, norm_offset),
    )


def _import_granite_rotary(data: Mapping[str, Any]) -> dict[str, Any]:
    kind = data.get("position_embedding_type")
    if kind not in ("rope", None):
        raise ConversionError(f"`position_embedding_type` = {kind!r} is not supported (rope, or null for none)")
    return _import_rotary(data) if kind == "rope" else {"rotary": {"type": "none"}}


def _export_granite_rotary(config: AttentionConfig) -> dict[str, Any]:
    if get_registry().name_of(type(config.rotary)) == "none":
        return {"position_embedding_type": None, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    return {"position_embedding_type": "rope", **_export_rotary(config)}


# Granite: RoPE only with `position_embedding_type` rope (transformers writes `rope_parameters` either way), and the
# softmax scale is `attention_multiplier` itself (not head_dim**-0.5).
GRANITE_ROTARY = Computed(
    ("rotary",),
    ("rope_parameters", "position_embedding_type"),
    import_=_import_granite_rotary,
    export=_export_granite_rotary,
)
# Granite has no `head_dim`: hidden / heads (the format checks it on export, where the hidden size is known).
IMPLIED_HEAD_SIZE = Computed(
    ("head_size",),
    (),
    import_=lambda data: {"head_size": data["hidden_size"] // data["num_attention_heads"]},
    export=lambda config: {},
)
GRANITE_SOFTMAX_SCALE = Computed(
    ("softmax_scale",),
    ("attention_multiplier",),
    import_=lambda data: {"softmax_scale": float(data.get("attention_multiplier", 1.0))},
    export=lambda config: {"attention_multiplier": config.resolved_softmax_scale},
)


def register_sections(register: Callable[[str, Section], None]) -> None:
    """The attention section of every Hugging Face format with attention."""
    register("llama", attention_section(biases=all_biases("attention_bias"), window=Constant("window_size", None)))
    register("mistral", attention_section(biases=all_biases(None), window=sliding_window(default=4096)))
    register("mixtral", attention_section(biases=all_biases(None), window=sliding_window(default=None)))
    # Qwen2 and Qwen2-MoE: the converter's layout gives each layer its `sliding_window` (None where full).
    register("qwen2", attention_section(biases=qkv_biases(None), window=sliding_window(default=None)))
    register("qwen2_moe", attention_section(biases=qkv_biases("qkv_bias"), window=sliding_window(default=None)))
    register(
        "qwen3",
        attention_section(biases=all_biases("attention_bias"), window=sliding_window(default=None), head_norms=True),
    )
    register("qwen3_moe", attention_section(biases=all_biases("attention_bias"), window=QWEN3_WINDOW, head_norms=True))
    # Qwen3-Next: gated attention, RoPE on a quarter of each head by default, (1 + w) head norms (the format's norms).
    register(
        "qwen3_next",
        attention_section(
            biases=all_biases("attention_bias"),
            window=Constant("window_size", None),
            head_norms=True,
            rotary=partial_rotary(0.25),
            output_gate=OUTPUT_GATE,
            norm_offset=1.0,
        ),
    )
    register(
        "granitemoehybrid",
        attention_section(
            biases=all_biases("attention_bias"),
            window=Constant("window_size", None),
            rotary=GRANITE_ROTARY,
            softmax_scale=GRANITE_SOFTMAX_SCALE,
            head_size=IMPLIED_HEAD_SIZE,
        ),
    )
    # Falcon-H1: Llama's attention, its keys scaled by `key_multiplier`.
    register(
        "falcon_h1",
        attention_section(
            biases=all_biases("attention_bias"),
            window=Constant("window_size", None),
            key_multiplier=Rename("key_multiplier", "key_multiplier", default=1.0),
        ),
    )
    # The Mamba hybrids: Jamba's attention has no rotary embeddings; Apriel's "t" layers are Mistral's.
    register(
        "jamba", attention_section(biases=all_biases(None), window=Constant("window_size", None), rotary=NO_ROTARY)
    )
    register("apriel_hybrid_ssm", attention_section(biases=all_biases(None), window=sliding_window(default=4096)))
    # Bamba: RoPE on half of each head unless `partial_rotary_factor` says otherwise. NemotronH: no RoPE, no biases.
    register(
        "bamba",
        attention_section(
            biases=all_biases("attention_bias"), window=Constant("window_size", None), rotary=partial_rotary(0.5)
        ),
    )
    register(
        "nemotron_h",
        attention_section(
            biases=all_biases(None),
            window=Constant("window_size", None),
            rotary=NO_ROTARY,
            name="mixer",
            extra=(
                Ignored(
                    theirs=("attention_bias", "sliding_window"),
                    reason="transformers' NemotronH attention reads neither: it has no biases and attends to every "
                    "earlier token",
                ),
            ),
        ),
    )
