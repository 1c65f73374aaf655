"""The Hugging Face format of Qwen3-Next (Qwen3NextForCausalLM). Torch-free.

Llama's layer (`input_layernorm`, `post_attention_layernorm`, `mlp`) whose mixer is Gated DeltaNet
(`linear_attn`, the gated_delta_net plugin's section) on the `linear_attention` layers of `layer_types` and gated
attention (`self_attn`: an output gate from the doubled q_proj, q/k norms, RoPE on a quarter of each head: the
attention plugin's section) on the `full_attention` ones; without `layer_types`, every `full_attention_interval`-th
layer is attention (transformers' rule). The MLP is Qwen2-MoE's (routed experts and a sigmoid-gated shared expert)
on the layers `mlp_only_layers` and `decoder_sparse_step` leave sparse, a dense MLP on the others.

Every RMSNorm of Qwen3-Next (the layers', the final one, the q/k norms) scales by (1 + w), its weights starting at
0; blockzoo's scales by w, so the weights are w + 1 here (computed in fp32, as transformers computes 1 + w) and
written back as w - 1 (exact for weights in [0.5, 2]). The Gated DeltaNet's own gated norm scales by w.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from blockzoo.conversion import ComputedWeights, ConversionError, Rename, Section
from blockzoo.layers.config import RMSNormalizationConfig
from blockzoo_huggingface.format import HuggingfaceFormat
from blockzoo_huggingface.layouts import Layer, SparseMoELayers, _layer_count
from blockzoo_huggingface.sections import decoder_block

_MIXERS = {"linear_attention": "gated_delta_net", "full_attention": "attention"}
_LAYER_TYPES = {mixer: layer_type for layer_type, mixer in _MIXERS.items()}


def offset_rms_norm(epsilon: str = "rms_norm_eps") -> Section:
    """An RMS norm whose format weight is w in RMSNorm(x) · (1 + w): blockzoo's weight is 1 + w."""
    return Section(
        config_class=RMSNormalizationConfig,
        config=(Rename("epsilon", epsilon),),
        weights=lambda config: [
            ComputedWeights(
                ("weight",),
                ("weight",),
                import_=lambda tensors: [tensors[0].float().add(1).to(tensors[0].dtype)],
                export=lambda tensors: [tensors[0].float().sub(1).to(tensors[0].dtype)],
            )
        ],
    )


@attrs.frozen(kw_only=True)
class Qwen3NextLayers(SparseMoELayers):
    """Qwen3-Next: each layer's mixer from `layer_types` (or `full_attention_interval`), its MLP as Qwen-MoE's."""

    @property
    def claims(self) -> tuple[str, ...]:
        return (*super().claims, "layer_types", "full_attention_interval")

    def layers(self, config: Mapping[str, Any]) -> list[Layer]:
        count = _layer_count(config)
        layer_types = config.get("layer_types")
        if layer_types is None:
            interval = config.get("full_attention_interval", 4)
            if not isinstance(interval, int) or interval < 1:
                raise ConversionError(f"`full_attention_interval` must be a positive integer, got {interval!r}")
            layer_types = [
                "full_attention" if (index + 1) % interval == 0 else "linear_attention" for index in range(count)
            ]
        if not isinstance(layer_types, list) or len(layer_types) != count or set(layer_types) - set(_MIXERS):
            raise ConversionError(f"`layer_types` must list {count} of {' / '.join(_MIXERS)}, got {layer_types!r}")
        return [
            Layer({**layer.types, "mixer": _MIXERS[layer_type]}, layer.config)
            for layer, layer_type in zip(super().layers(config), layer_types)
        ]

    def merge(self, layers: Sequence[Layer], format_name: str) -> dict[str, Any]:
        for index, layer in enumerate(layers):
            if layer.types["mixer"] not in _LAYER_TYPES:
                raise ConversionError(
                    f"decoder.{index}.mixer: type {layer.types['mixer']!r} cannot be written in the {format_name} "
                    "format (only gated_delta_net or attention)"
                )
        as_attention = [Layer({**layer.types, "mixer": self.mixer}, layer.config) for layer in layers]
        return {
            **super().merge(as_attention, format_name),
            "layer_types": [_LAYER_TYPES[layer.types["mixer"]] for layer in layers],
        }


QWEN3_NEXT_FORMATS = (
    HuggingfaceFormat(
        name="qwen3_next",
        model_type="qwen3_next",
        architecture="Qwen3NextForCausalLM",
        layout=Qwen3NextLayers(),
        core_sections=(decoder_block(), offset_rms_norm()),
        defaults={"rms_norm_eps": 1e-6, "head_dim": 256},
        ignored_tensors=(r"mtp\..*",),  # the multi-token-prediction head, which transformers does not load either
        description="Qwen3-Next: Gated DeltaNet and gated attention layers (layer_types), (1 + w) RMSNorms, MoE with "
        "a gated shared expert",
    ),
)
