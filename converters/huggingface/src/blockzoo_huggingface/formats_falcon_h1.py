"""The Hugging Face format of Falcon-H1: falcon_h1 (FalconH1ForCausalLM). Torch-free.

Every layer is one blockzoo `parallel` block: `input_layernorm`, then attention (`self_attn`, Llama's, its keys times
`key_multiplier`) and Mamba 2 (`mamba`) side by side on the same normalized input, their outputs scaled and summed
into the residual, then `pre_ff_layernorm` and the MLP (`feed_forward`). The μP multipliers, each to its own field:
`embedding_multiplier` (`embeddings.multiplier`), `lm_head_multiplier` (`head.logits_multiplier`),
`attention_in_multiplier` / `ssm_in_multiplier` (the block's `input_multipliers`), `attention_out_multiplier` /
`ssm_out_multiplier` (its `output_multipliers`), `key_multiplier` (the attention's), `ssm_multipliers` (Mamba 2's
`in_proj_multipliers` over z, x, B, C, dt: transformers' mup_vector) and `mlp_multipliers` (the MLP's gate and down
multipliers). The mixers' and the MLP's keys are their plugins' sections; this module has the block and the model.

Mamba 2's output norm (by the Mamba 2 section): `mamba_rms_norm` false, transformers' default, is no norm and no
norm weight (`normalization.enabled: false`); true with `mamba_norm_before_gate` true normalizes, then gates
(`normalization.norm_before_gate: true`), as transformers' torch path computes them. Refused: a `residual_multiplier`
other than 1, a block of other mixers than one attention and one mamba_2.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from blockzoo.api import get_registry
from blockzoo.conversion import (
    Computed,
    Constant,
    ConversionError,
    Ignored,
    Nested,
    Part,
    Rename,
    Section,
    export_config,
    import_config,
    merge_keys,
    section_for,
)
from blockzoo.model.config import ParallelBlockConfig
from blockzoo_huggingface.format import HuggingfaceFormat
from blockzoo_huggingface.layouts import Layer, _layer_count, merge_layers
from blockzoo_huggingface.mamba2_format_helpers import _untag_floats
from blockzoo_huggingface.sections import rms_norm, transformer_model

FORMAT = "falcon_h1"
# The block's mixer of each type, by the name an import gives it (its parameters are `mixers.<name>.…`), and the
# format's keys of its input and output multipliers.
MIXERS = {"attention": "attention", "mamba": "mamba_2"}
MULTIPLIER_KEYS = {
    "input_multipliers": {"attention": "attention_in_multiplier", "mamba": "ssm_in_multiplier"},
    "output_multipliers": {"attention": "attention_out_multiplier", "mamba": "ssm_out_multiplier"},
}


def _mixer_names(config: ParallelBlockConfig) -> dict[str, str]:
    """The block's name of its attention and of its Mamba 2 ({"attention": name, "mamba": name}); any other set of
    mixers cannot be written."""
    registry = get_registry()
    types = {name: registry.name_of(type(mixer)) for name, mixer in config.mixers.items()}
    if sorted(types.values()) != sorted(MIXERS.values()):
        raise ConversionError(
            f"`mixers` of types {types} cannot be written: a Falcon-H1 block has one attention and one mamba_2"
        )
    return {role: next(name for name, kind in types.items() if kind == MIXERS[role]) for role in MIXERS}


def _import_mixers(data: Mapping[str, Any]) -> dict[str, Any]:
    mixers = {}
    for name, kind in MIXERS.items():
        config_class = get_registry().resolve("mixer", kind).config_class
        path = f"mixers.{name}"
        mixers[name] = import_config(FORMAT, section_for(FORMAT, config_class, path), data, path=path)
    return {"mixers": mixers}


def _export_mixers(config: ParallelBlockConfig) -> dict[str, Any]:
    keys: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for name in _mixer_names(config).values():
        path = f"mixers.{name}"
        merge_keys(keys, origins, export_config(FORMAT, config.mixers[name], path=path), path)
    return keys


def _multipliers(field_name: str) -> Computed:
    """`input_multipliers` or `output_multipliers` ↔ the format's key of each mixer's (1 where absent)."""
    theirs = MULTIPLIER_KEYS[field_name]

    def import_(data: Mapping[str, Any]) -> dict[str, Any]:
        values = {name: float(data.get(key, 1.0)) for name, key in theirs.items()}
        return {field_name: {name: value for name, value in values.items() if value != 1}}

    def export(config: ParallelBlockConfig) -> dict[str, Any]:
        names = _mixer_names(config)
        multipliers = getattr(config, field_name)
        return {key: multipliers.get(names[role], 1.0) for role, key in theirs.items()}

    return Computed((field_name,), tuple(theirs.values()), import_=import_, export=export)


def _block_weights(config: ParallelBlockConfig) -> list[Nested]:
    names = _mixer_names(config)
    mappings = [Nested("norm_1", config.normalization, "input_layernorm")]
    mappings += [Nested(f"mixers.{names[role]}", config.mixers[names[role]]) for role in MIXERS]
    return [*mappings, Nested("norm_2", config.normalization, "pre_ff_layernorm"), Nested("mlp", config.mlp)]


def parallel_block() -> Section:
    """Falcon-H1's layer as a `parallel` block: the mixers' keys through their own sections (under `self_attn` and
    `mamba`), the input and output multipliers, the MLP (`feed_forward`) and the two norms."""
    return Section(
        config_class=ParallelBlockConfig,
        config=(
            Computed(("mixers",), (), import_=_import_mixers, export=_export_mixers),
            _multipliers("input_multipliers"),
            _multipliers("output_multipliers"),
            Constant("residual_multiplier", 1.0),
        ),
        parts=(Part("mlp", type="mlp"), Part("normalization", type="rms_norm")),
        weights=_block_weights,
    )


@attrs.frozen(kw_only=True)
class ParallelLayers:
    """Every layer the same parallel block (transformers' `layers_block_type` is "hybrid" on every layer)."""

    @property
    def claims(self) -> tuple[str, ...]:
        return ("num_hidden_layers",)

    def layers(self, config: Mapping[str, Any]) -> list[Layer]:
        return [Layer({}, config)] * _layer_count(config)

    def merge(self, layers: Sequence[Layer], format_name: str) -> dict[str, Any]:
        # The block section checks each layer's parts; one value per key across layers, as every format.
        return {**merge_layers(layers, format_name), "num_hidden_layers": len(layers)}


def _falcon_legacy(config: dict[str, Any]) -> dict[str, Any]:
    # transformers 4.x reads a bare Infinity (time_step_limit), not 5.x's tagged one.
    return _untag_floats(config)


FALCON_H1_FORMATS = (
    HuggingfaceFormat(
        name=FORMAT,
        model_type="falcon_h1",
        architecture="FalconH1ForCausalLM",
        layout=ParallelLayers(),
        block_class=ParallelBlockConfig,
        model_section=transformer_model(
            extra=(Ignored(theirs=("num_logits_to_keep",), reason="a generation option, not the architecture"),),
            final_norm="final_layernorm",
            embedding_multiplier=Rename("embeddings.multiplier", "embedding_multiplier", default=1.0),
            logits_multiplier=Rename("head.logits_multiplier", "lm_head_multiplier", default=1.0),
        ),
        core_sections=(parallel_block(), rms_norm("rms_norm_eps")),
        # transformers' FalconH1Config defaults of the keys a config.json may omit.
        defaults={
            "rms_norm_eps": 1e-5,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "mamba_d_ssm": 1024,
            "mamba_n_heads": 128,
            "mamba_d_head": "auto",
            "mamba_n_groups": 1,
            "mamba_d_state": 256,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_chunk_size": 256,
            "mamba_conv_bias": True,
            "mamba_proj_bias": False,
            "mamba_norm_before_gate": True,
            "mamba_rms_norm": False,
            "projectors_bias": False,
        },
        legacy=_falcon_legacy,
        description="Falcon-H1: attention ‖ Mamba 2 in one parallel block on every layer, μP multipliers (embedding, "
        "lm_head, attention / SSM in and out, key, ssm_multipliers over z x B C dt, MLP gate and down)",
    ),
)
