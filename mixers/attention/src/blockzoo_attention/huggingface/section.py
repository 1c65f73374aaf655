"""The builder of the Llama-style attention section, `attention_section`, from a format's config mappings.
Torch-free."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from blockzoo.api import Computed, ConfigMapping, Constant, ConversionError, Fixed, Ignored, Part, Rename, Section
from blockzoo_attention.config import AttentionConfig
from blockzoo_attention.huggingface.config_mappings import NO_KEY_MULTIPLIER, NO_OUTPUT_GATE, ROTARY
from blockzoo_attention.huggingface.weight_mappings import _weights


def _head_size(data: Mapping[str, Any]) -> dict[str, Any]:
    head_dim = data.get("head_dim")
    return {"head_size": head_dim if head_dim is not None else data["hidden_size"] // data["num_attention_heads"]}


def _softmax_scale(config: AttentionConfig) -> dict[str, Any]:
    if not math.isclose(config.resolved_softmax_scale, config.head_size**-0.5, rel_tol=1e-12):
        raise ConversionError(
            f"`softmax_scale` {config.softmax_scale} cannot be written: the format uses head_dim**-0.5"
        )
    return {}


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
