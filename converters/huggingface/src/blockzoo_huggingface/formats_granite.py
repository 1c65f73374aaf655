"""The Hugging Face format of the Granite-4.0 hybrids: granitemoehybrid (GraniteMoeHybridForCausalLM). Torch-free.

Every layer is Llama's (`input_layernorm`, `post_attention_layernorm`) with Mamba 2 (`mamba`, Bamba's mixer and
keys) or attention (`self_attn`, RoPE only with `position_embedding_type` rope, the softmax scale
`attention_multiplier`) listed in `layer_types`, then a MoE whose shared MLP (`shared_mlp`) sits beside the experts
(`block_sparse_moe`). The multipliers: `embedding_multiplier` (blockzoo's `embeddings.multiplier`),
`residual_multiplier` (each block's, on both branches), `logits_scaling` (the logits are divided by it: blockzoo's
`head.logits_multiplier` is its inverse).

Refused: a model without experts (`num_local_experts` 0: its layers are a dense `shared_mlp` only, which blockzoo's
MLP sections do not write under that name).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from blockzoo.api import get_registry
from blockzoo.conversion import Computed, ConversionError, Rename
from blockzoo.model.config import ModelConfig
from blockzoo_huggingface.format import HuggingfaceFormat
from blockzoo_huggingface.layouts import Layer, _layer_count, merge_layers
from blockzoo_huggingface.mamba2_format_helpers import _check_types, _untag_floats, inner_size
from blockzoo_huggingface.sections import decoder_block, rms_norm, transformer_model

# layer_types names (transformers 5, and the 4.x names 5 still maps) -> the mixer's type.
_MIXERS = {"linear_attention": "mamba_2", "mamba": "mamba_2", "full_attention": "attention", "attention": "attention"}
_NAMES = {"mamba_2": "linear_attention", "attention": "full_attention"}
_LEGACY_NAMES = {"linear_attention": "mamba", "full_attention": "attention"}


@attrs.frozen(kw_only=True)
class GraniteLayers:
    """Granite: `layer_types` lists each layer's mixer (Mamba 2 by default); every layer ends with the MoE."""

    @property
    def claims(self) -> tuple[str, ...]:
        return ("num_hidden_layers", "layer_types")

    def layers(self, config: Mapping[str, Any]) -> list[Layer]:
        count = _layer_count(config)
        names = config.get("layer_types") or ["linear_attention"] * count
        if not isinstance(names, list) or len(names) != count or not set(names) <= set(_MIXERS):
            raise ConversionError(
                f"`layer_types` must list {count} of linear_attention / full_attention, got {names!r}"
            )
        if config.get("num_local_experts", 8) == 0:
            raise ConversionError(
                "`num_local_experts` = 0 (a dense shared_mlp only) is not supported by the granitemoehybrid conversion"
            )
        return [Layer({"mixer": _MIXERS[name], "mlp": "moe"}, config) for name in names]

    def merge(self, layers: Sequence[Layer], format_name: str) -> dict[str, Any]:
        allowed = [{"mixer": "attention", "mlp": "moe"}, {"mixer": "mamba_2", "mlp": "moe"}]
        _check_types(layers, allowed, format_name, "each layer is Mamba 2 or attention, then a MoE")
        return {
            **merge_layers(layers, format_name),
            "num_hidden_layers": len(layers),
            "layer_types": [_NAMES[layer.types["mixer"]] for layer in layers],
        }


def _granite_legacy(config: dict[str, Any]) -> dict[str, Any]:
    # transformers 4.x names the layers mamba / attention and reads a bare Infinity.
    config = _untag_floats(config)
    return {**config, "layer_types": [_LEGACY_NAMES[name] for name in config["layer_types"]]}


def _check_head_sizes(model: ModelConfig) -> dict[str, Any]:
    for index, (_, block) in enumerate(model.decoder.expanded_blocks()):
        mixer = block.mixer
        if get_registry().name_of(type(mixer)) == "attention" and mixer.heads * mixer.head_size != model.hidden_size:
            raise ConversionError(
                f"decoder.{index}.mixer: heads · head_size ({mixer.heads} · {mixer.head_size}) cannot be written: "
                f"Granite's head size is hidden_size / heads ({model.hidden_size} / {mixer.heads})"
            )
    return {}


def _export_logits_scaling(config: Any) -> dict[str, Any]:
    multiplier = config.head.logits_multiplier
    if multiplier <= 0:
        raise ConversionError(f"`head.logits_multiplier` = {multiplier} cannot be written: Granite divides by it")
    return {"logits_scaling": 1 / multiplier}


def _import_logits_scaling(data: Mapping[str, Any]) -> dict[str, Any]:
    scaling = data.get("logits_scaling", 1.0)
    if not scaling or scaling <= 0:
        raise ConversionError(f"`logits_scaling` = {scaling!r}: the logits are divided by it, so it must be positive")
    return {"head.logits_multiplier": 1 / scaling}


GRANITE_FORMATS = (
    HuggingfaceFormat(
        name="granitemoehybrid",
        model_type="granitemoehybrid",
        architecture="GraniteMoeHybridForCausalLM",
        layout=GraniteLayers(),
        model_section=transformer_model(
            extra=(
                inner_size("mamba_expand", "mamba_n_heads", "mamba_d_head"),
                Computed((), (), export=_check_head_sizes),
            ),
            embedding_multiplier=Rename("embeddings.multiplier", "embedding_multiplier", default=1.0),
            logits_multiplier=Computed(
                ("head.logits_multiplier",),
                ("logits_scaling",),
                import_=_import_logits_scaling,
                export=_export_logits_scaling,
            ),
        ),
        core_sections=(
            decoder_block(residual_multiplier=Rename("residual_multiplier", "residual_multiplier", default=1.0)),
            rms_norm("rms_norm_eps"),
        ),
        defaults={
            "rms_norm_eps": 1e-6,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "attention_bias": False,
            "attention_multiplier": 1.0,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "shared_intermediate_size": 1024,
            "mamba_n_heads": 128,
            "mamba_d_head": "auto",
            "mamba_n_groups": 1,
            "mamba_d_state": 256,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_chunk_size": 256,
            "mamba_conv_bias": True,
            "mamba_proj_bias": False,
        },
        legacy=_granite_legacy,
        description="Granite-4.0 hybrid: Mamba 2 or attention per layer (layer_types), MoE with a shared MLP, "
        "embedding / residual / attention / logits multipliers",
    ),
)
