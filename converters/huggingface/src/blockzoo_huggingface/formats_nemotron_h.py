"""The Hugging Face format of Nemotron-H: nemotron_h (NemotronHForCausalLM), one of the Mamba 2 formats
(`formats_mamba2.MAMBA2_FORMATS`). Torch-free.

One mixer or one MLP per layer, one norm (`backbone.layers.N.{norm,mixer}`), the layers listed in
`layers_block_type` (or transformers 4.x's `hybrid_override_pattern`: `M` Mamba 2, `*` attention, `-` MLP, `E` MoE);
the gated norm per group, attention without RoPE, MLPs without gate, MoE layers with the sigmoid router of
DeepSeek-V3 (groups, score correction bias, scaling factor; the moe plugin's `sigmoid_top_k`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from blockzoo.conversion import Computed, ConfigMapping, ConversionError, Fixed, Ignored, Section
from blockzoo.model.config import ModelConfig
from blockzoo_huggingface.format import HuggingfaceFormat
from blockzoo_huggingface.layouts import Layer, merge_layers
from blockzoo_huggingface.mamba2_format_helpers import NO_PARTS, _check_types, _untag_floats
from blockzoo_huggingface.sections import decoder_block, rms_norm, transformer_model

# layers_block_type (with the names transformers 5 still maps from 4.x's) -> the layer's pattern character.
_NEMOTRON_CHARACTERS = {
    "linear_attention": "M",
    "mamba": "M",
    "full_attention": "*",
    "attention": "*",
    "mlp": "-",
    "moe": "E",
}
_NEMOTRON_NAMES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_NEMOTRON_PARTS = {
    "M": {"mixer": "mamba_2", "mlp": "none"},
    "*": {"mixer": "attention", "mlp": "none"},
    "-": {"mixer": "none", "mlp": "mlp"},
    "E": {"mixer": "none", "mlp": "moe"},
}
# The keys of its MoE layers (the moe plugin's section reads them).
_NEMOTRON_MOE_KEYS = (
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_overlap",
    "moe_latent_size",
    "routed_scaling_factor",
    "n_group",
    "topk_group",
    "norm_topk_prob",
)
# The names of transformers 4.x-era NemotronH configs that transformers 5 still reads (the old name wins).
_NEMOTRON_OLD_KEYS = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_expand": "expand",
    "mamba_dt_min": "time_step_min",
    "mamba_dt_max": "time_step_max",
    "mamba_dt_limit": "time_step_limit",
    "mamba_dt_init_floor": "time_step_floor",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
}


@attrs.frozen(kw_only=True)
class NemotronHLayers:
    """NemotronH: one mixer (Mamba 2 `M`, attention `*`) or one MLP (`-`) or MoE (`E`) per layer, from
    `layers_block_type` or the `hybrid_override_pattern` string. Each layer's sections read transformers 5's names
    (`_NEMOTRON_OLD_KEYS` renamed)."""

    @property
    def claims(self) -> tuple[str, ...]:
        return (
            "layers_block_type",
            "hybrid_override_pattern",
            "num_hidden_layers",
            *_NEMOTRON_OLD_KEYS,
        )

    def pattern(self, config: Mapping[str, Any]) -> str:
        """The layers as a pattern string (`num_hidden_layers` is not read: transformers 5 ignores it too)."""
        if config.get("layers_block_type") is not None:
            names = config["layers_block_type"]
            if not isinstance(names, list) or not names or not set(names) <= set(_NEMOTRON_CHARACTERS):
                raise ConversionError(
                    f"`layers_block_type` must list {', '.join(_NEMOTRON_NAMES.values())} layers, got {names!r}"
                )
            return "".join(_NEMOTRON_CHARACTERS[name] for name in names)
        pattern = config.get("hybrid_override_pattern")
        if not isinstance(pattern, str) or not pattern or not set(pattern) <= set(_NEMOTRON_NAMES):
            raise ConversionError(
                f"`layers_block_type` is missing, and `hybrid_override_pattern` must be a string of M, *, - and E, "
                f"got {pattern!r}"
            )
        return pattern

    def layers(self, config: Mapping[str, Any]) -> list[Layer]:
        config = {**config, **{new: config[old] for old, new in _NEMOTRON_OLD_KEYS.items() if old in config}}
        layers = []
        for character in self.pattern(config):
            layers.append(Layer(_NEMOTRON_PARTS[character], config))
        return layers

    def merge(self, layers: Sequence[Layer], format_name: str) -> dict[str, Any]:
        hint = "each layer is one Mamba 2 or attention mixer, or one MLP: split a block with both in two"
        _check_types(layers, list(_NEMOTRON_PARTS.values()), format_name, hint)
        characters = {tuple(parts.values()): character for character, parts in _NEMOTRON_PARTS.items()}
        pattern = [characters[(layer.types["mixer"], layer.types["mlp"])] for layer in layers]
        return {
            **merge_layers(layers, format_name),
            "layers_block_type": [_NEMOTRON_NAMES[character] for character in pattern],
        }


def _nemotron_h_legacy(config: dict[str, Any]) -> dict[str, Any]:
    # NemotronH is not in transformers 4.x; its remote code (and its configs) use the pattern string.
    names = config.pop("layers_block_type")
    pattern = "".join(_NEMOTRON_CHARACTERS[name] for name in names)
    return {**_untag_floats(config), "hybrid_override_pattern": pattern, "num_hidden_layers": len(pattern)}


def _untied(config: ModelConfig) -> dict[str, Any]:
    if config.tied_embedding_weight:
        raise ConversionError(
            "`tied_embedding_weight` = True cannot be written: transformers' NemotronH never ties the output weight "
            "to the embeddings"
        )
    return {"tie_word_embeddings": False}


# transformers' NemotronH has its own lm_head whatever `tie_word_embeddings` says.
_NEMOTRON_UNTIED = Computed(
    ("tied_embedding_weight",),
    ("tie_word_embeddings",),
    import_=lambda data: {"tied_embedding_weight": False},
    export=_untied,
)


def _check_attention_head_dim(data: Mapping[str, Any]) -> dict[str, Any]:
    # The remote code of transformers 4.x read `attention_head_dim`; transformers 5 reads `head_dim` only.
    old, new = data.get("attention_head_dim"), data.get("head_dim")
    if old is not None and old != new:
        raise ConversionError(
            f"`attention_head_dim` = {old} and `head_dim` = {new}: the remote code of transformers 4.x used the "
            "first, transformers 5 uses the second; make them agree"
        )
    return {}


# What configs written for the remote code of transformers 4.x add: keys transformers 5 reads no more.
_NEMOTRON_REMOTE_CODE_KEYS = (
    Computed((), ("attention_head_dim",), import_=_check_attention_head_dim),
    Ignored(
        theirs=("auto_map", "hidden_act", "rms_norm_eps"),
        reason="keys of the remote code, unread by transformers 5's NemotronH (the MLPs' activation is "
        "`mlp_hidden_act`, the norms' epsilon `layer_norm_epsilon`)",
    ),
)


def _with(section: Section, mapping: ConfigMapping) -> Section:
    """`section` with `mapping` in place of the mapping that claims the same fields."""
    config = tuple(other for other in section.config if other.ours != mapping.ours)
    return attrs.evolve(section, config=(*config, mapping))


_NOT_READ = "transformers' model does not read it"

NEMOTRON_H_FORMATS = (
    HuggingfaceFormat(
        name="nemotron_h",
        model_type="nemotron_h",
        architecture="NemotronHForCausalLM",
        layout=NemotronHLayers(),
        model_section=_with(
            transformer_model(
                extra=(
                    Fixed("num_nextn_predict_layers", 0),
                    Ignored(
                        theirs=("mtp_layers_block_type", "mtp_hybrid_override_pattern"),
                        reason="the layers of multi-token prediction, which num_nextn_predict_layers 0 leaves out",
                    ),
                    Ignored(theirs=("residual_in_fp32", "hidden_dropout"), reason=_NOT_READ),
                    Ignored(theirs=("use_mamba_kernels",), reason="deprecated; the kernels are chosen for the device"),
                    Ignored(theirs=("rescale_prenorm_residual",), reason="an initialization option"),
                    Ignored(theirs=("num_logits_to_keep",), reason="a generation option"),
                    # transformers 5.24 writes it (its MoE layers' output option), whatever the layers are.
                    Ignored(theirs=("output_router_logits",), reason="an output option of transformers"),
                    Ignored(
                        theirs=(*_NEMOTRON_MOE_KEYS, "intermediate_size", "mlp_bias", "mlp_hidden_act"),
                        reason="the keys of the MoE (`E`) and MLP (`-`) layers, in a model without them",
                    ),
                    *_NEMOTRON_REMOTE_CODE_KEYS,
                ),
                prefix="backbone",
                embeddings="embeddings",
                final_norm="norm_f",
            ),
            _NEMOTRON_UNTIED,
        ),
        core_sections=(decoder_block("norm", "norm"), rms_norm("layer_norm_epsilon"), *NO_PARTS),
        defaults={
            "layer_norm_epsilon": 1e-5,
            "head_dim": 128,
            "mlp_hidden_act": "relu2",
            "mlp_bias": False,
            "mamba_hidden_act": "silu",
            "n_groups": 8,
            "conv_kernel": 4,
            "chunk_size": 128,
            "use_bias": False,
            "use_conv_bias": True,
            "time_step_min": 1e-3,
        },
        default_rope_theta=None,
        legacy=_nemotron_h_legacy,
        ignored_tensors=(),
        description="NemotronH: one Mamba 2 (per-group norm), attention (no RoPE) or MLP (no gate) per layer",
    ),
)
