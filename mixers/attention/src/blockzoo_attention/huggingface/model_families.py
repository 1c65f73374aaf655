"""Config mappings that only one model family uses: Qwen3-MoE's window, Qwen3-Next's output gate, Granite's
rotary embeddings, softmax scale and head size. Torch-free."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from blockzoo.api import Computed, ConversionError, get_registry
from blockzoo_attention.config import AttentionConfig
from blockzoo_attention.huggingface.config_mappings import _export_rotary, _import_rotary

# Qwen3-MoE: `sliding_window` counts only with `use_sliding_window`, on every layer (transformers 5;
# `max_window_layers` is no longer read).
QWEN3_WINDOW = Computed(
    ("window_size",),
    ("use_sliding_window", "sliding_window", "max_window_layers"),
    import_=lambda data: {"window_size": data.get("sliding_window") if data.get("use_sliding_window") else None},
    export=lambda config: {"use_sliding_window": config.window_size is not None, "sliding_window": config.window_size},
)


def _export_output_gate(config: AttentionConfig) -> dict[str, Any]:
    if config.output_gate is None or config.has_bias(config.output_gate) != config.has_bias(config.query):
        raise ConversionError(
            "`output_gate` must be set, with a bias exactly when the query has one: Qwen3-Next's attention gates its "
            "output with rows of q_proj"
        )
    return {}


# Qwen3-Next: q_proj computes each head's query and output gate.
OUTPUT_GATE = Computed(("output_gate",), (), import_=lambda data: {"output_gate": {}}, export=_export_output_gate)


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
