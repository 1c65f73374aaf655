"""The Hugging Face formats of Mamba 2 and its hybrids: mamba2 (Mamba2ForCausalLM), bamba (BambaForCausalLM),
nemotron_h (NemotronHForCausalLM, in formats_nemotron_h.py). Torch-free.

- `mamba2`: every layer a Mamba 2 mixer without MLP, `backbone.layers.N.{norm,mixer}`, `backbone.embeddings`,
  `backbone.norm_f`; the gated norm over the whole inner dimension.
- `bamba`: Llama's layer (`input_layernorm`, `pre_ff_layernorm`, `feed_forward`) whose mixer is attention on the
  layers of `attn_layer_indices` (RoPE on part of each head, `partial_rotary_factor`) and Mamba 2 (`mamba`) on the
  others; `model.final_layernorm`.
- `nemotron_h`: Mamba 2, attention, MLP or MoE layers by a pattern; described in formats_nemotron_h.py.

The sections of the mixers and MLPs come from their plugins; the Mamba 2 inner size (`expand` · hidden size in
transformers) is checked and written by the format (`inner_size`, in mamba2_format_helpers.py), where the hidden size
is known.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from blockzoo.conversion import ConversionError, Ignored
from blockzoo_huggingface.format import HuggingfaceFormat
from blockzoo_huggingface.formats_nemotron_h import NEMOTRON_H_FORMATS, NemotronHLayers
from blockzoo_huggingface.layouts import Layer, Uniform, _layer_count, merge_layers
from blockzoo_huggingface.mamba2_format_helpers import INFINITY, NO_PARTS, _check_types, _untag_floats, inner_size
from blockzoo_huggingface.sections import decoder_block, rms_norm, transformer_model

# Its public names, and those of formats_nemotron_h.py and mamba2_format_helpers.py once defined here (importable).
__all__ = ["INFINITY", "MAMBA2_FORMATS", "NO_PARTS", "AttentionIndexLayers", "NemotronHLayers", "inner_size"]

# ---------------------------------------------------------------------------------------------------------------------
# Bamba


@attrs.frozen(kw_only=True)
class AttentionIndexLayers:
    """Bamba: the layers listed in `attn_layer_indices` are attention, the others Mamba 2; each has an MLP."""

    @property
    def claims(self) -> tuple[str, ...]:
        return ("num_hidden_layers", "attn_layer_indices")

    def layers(self, config: Mapping[str, Any]) -> list[Layer]:
        count = _layer_count(config)
        indices = config.get("attn_layer_indices") or []
        if not isinstance(indices, list) or not all(isinstance(i, int) and 0 <= i < count for i in indices):
            raise ConversionError(f"`attn_layer_indices` must list layers in [0, {count}), got {indices!r}")
        return [
            Layer({"mixer": "attention" if index in indices else "mamba_2", "mlp": "mlp"}, config)
            for index in range(count)
        ]

    def merge(self, layers: Sequence[Layer], format_name: str) -> dict[str, Any]:
        allowed = [{"mixer": "attention", "mlp": "mlp"}, {"mixer": "mamba_2", "mlp": "mlp"}]
        _check_types(layers, allowed, format_name, "each layer is attention or Mamba 2, then a dense MLP")
        return {
            **merge_layers(layers, format_name),
            "num_hidden_layers": len(layers),
            "attn_layer_indices": [index for index, layer in enumerate(layers) if layer.types["mixer"] == "attention"],
        }


def _bamba_legacy(config: dict[str, Any]) -> dict[str, Any]:
    # transformers 4.x's Bamba rotates half of each head whatever the config says, and reads `rope_theta` only.
    config = _untag_floats(config)
    rope = config.pop("rope_scaling", None) or {}
    half = {"rope_type": "default", "partial_rotary_factor": 0.5}
    if {**half, **rope} != half:
        raise ConversionError(
            f"transformers 4.x's Bamba has default RoPE on half of each head only; this model's attention has {rope}"
        )
    return config


MAMBA2_FORMATS = (
    HuggingfaceFormat(
        name="mamba2",
        model_type="mamba2",
        architecture="Mamba2ForCausalLM",
        layout=Uniform(mixer="mamba_2", mlp="none"),
        model_section=transformer_model(
            extra=(
                inner_size("expand", "num_heads", "head_dim"),
                Ignored(
                    theirs=("residual_in_fp32",),
                    reason="the residual's dtype under a lower-precision compute dtype (blockzoo's follows the "
                    "compute dtype; the same in fp32)",
                ),
                Ignored(theirs=("rescale_prenorm_residual",), reason="an initialization option"),
            ),
            prefix="backbone",
            embeddings="embeddings",
            final_norm="norm_f",
        ),
        core_sections=(decoder_block("norm", "norm"), rms_norm("layer_norm_epsilon"), *NO_PARTS),
        defaults={
            "layer_norm_epsilon": 1e-5,
            "tie_word_embeddings": False,
            "expand": 2,
            "conv_kernel": 4,
            "n_groups": 8,
            "use_bias": False,
            "use_conv_bias": True,
            "hidden_act": "silu",
            "chunk_size": 256,
        },
        default_rope_theta=None,
        legacy=_untag_floats,
        ignored_tensors=(),
        description="Mamba 2: Mamba 2 mixers without MLP, the gated norm over the whole inner dimension",
    ),
    HuggingfaceFormat(
        name="bamba",
        model_type="bamba",
        architecture="BambaForCausalLM",
        layout=AttentionIndexLayers(),
        model_section=transformer_model(
            extra=(
                inner_size("mamba_expand", "mamba_n_heads", "mamba_d_head"),
                Ignored(theirs=("num_logits_to_keep",), reason="a generation option"),
                Ignored(theirs=("z_loss_coefficient",), reason="a training loss on the logits"),
            ),
            final_norm="final_layernorm",
        ),
        core_sections=(decoder_block("input_layernorm", "pre_ff_layernorm"), rms_norm("rms_norm_eps"), *NO_PARTS),
        defaults={
            "rms_norm_eps": 1e-5,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "mamba_d_head": "auto",
            "mamba_n_groups": 1,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_chunk_size": 256,
            "mamba_conv_bias": True,
            "mamba_proj_bias": False,
        },
        legacy=_bamba_legacy,
        description="Bamba: attention (on attn_layer_indices, partial RoPE) or Mamba 2, and an MLP in every layer",
    ),
    *NEMOTRON_H_FORMATS,
)
