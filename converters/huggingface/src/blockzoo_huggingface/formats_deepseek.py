"""The Hugging Face format of DeepSeek-V3 (DeepseekV3ForCausalLM). Torch-free.

Llama's layer around multi-head latent attention (the `mla` plugin's section) and an MLP that is dense on the first
`first_k_dense_replace` layers (`intermediate_size`) and DeepSeek's sigmoid-routed MoE after them (the `moe`
plugin's section: groups, correction bias, scaling factor, shared experts). The multi-token-prediction layers of
DeepSeek's own checkpoints (`num_nextn_predict_layers`) are not part of transformers' model, nor of the import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from blockzoo.conversion import ConversionError, Fixed, Ignored
from blockzoo_huggingface.format import HuggingfaceFormat
from blockzoo_huggingface.layouts import Layer, Uniform, _layer_count
from blockzoo_huggingface.sections import transformer_model


@attrs.frozen(kw_only=True)
class FirstDenseLayers(Uniform):
    """DeepSeek-V3: layer i has a dense MLP when i < `first_k_dense_replace`, the MoE after."""

    mixer: str = "mla"
    mlp: str = "moe"

    @property
    def claims(self) -> tuple[str, ...]:
        return ("num_hidden_layers", "first_k_dense_replace")

    def _mlp_types(self) -> tuple[str, ...]:
        return ("moe", "mlp")

    def layers(self, config: Mapping[str, Any]) -> list[Layer]:
        count = _layer_count(config)
        dense = config.get("first_k_dense_replace", 3)
        if not isinstance(dense, int) or dense < 0:
            raise ConversionError(f"`first_k_dense_replace` must be a non-negative integer, got {dense!r}")
        return [
            Layer({"mixer": self.mixer, "mlp": "mlp" if index < dense else "moe"}, config) for index in range(count)
        ]

    def merge(self, layers: Sequence[Layer], format_name: str) -> dict[str, Any]:
        kinds = [layer.types["mlp"] for layer in layers]
        dense = kinds.index("moe") if "moe" in kinds else len(kinds)
        if "mlp" in kinds[dense:]:
            raise ConversionError(
                f"decoder.{dense + kinds[dense:].index('mlp')}: a dense MLP after a MoE layer cannot be written in "
                f"the {format_name} format (its dense layers are the first ones, `first_k_dense_replace`)"
            )
        return {**super().merge(layers, format_name), "first_k_dense_replace": dense}


DEEPSEEK_FORMATS = (
    HuggingfaceFormat(
        name="deepseek_v3",
        model_type="deepseek_v3",
        architecture="DeepseekV3ForCausalLM",
        layout=FirstDenseLayers(),
        model_section=transformer_model(
            extra=(
                Fixed("pretraining_tp", 1),
                Ignored(
                    theirs=("num_nextn_predict_layers",),
                    reason="DeepSeek's multi-token-prediction layers, which transformers' model does not build",
                ),
            ),
        ),
        # transformers' DeepseekV3Config defaults, for configs that omit them.
        defaults={
            "rms_norm_eps": 1e-6,
            "hidden_act": "silu",
            "intermediate_size": 18432,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "rope_interleave": True,
            "attention_bias": False,
            "first_k_dense_replace": 3,
            "tie_word_embeddings": False,
        },
        # transformers drops layer 61, the multi-token-prediction layer of DeepSeek-V3's own checkpoint, likewise.
        ignored_tensors=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"model\.layers\.61\..*"),
        description="DeepSeek-V3: multi-head latent attention, dense MLPs on the first layers, then sigmoid-routed "
        "MoE (groups, correction bias, shared experts)",
    ),
)
