"""NemotronH's MoE section (`mixer`): ungated experts, shared experts of their own width, DeepSeek-V3's router."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from blockzoo.api import (
    Computed,
    Concatenated,
    Constant,
    ConversionError,
    Fixed,
    Ignored,
    Section,
    Weight,
    format_activation,
)
from blockzoo_moe.config import MoEMLPConfig
from blockzoo_moe.huggingface.common_mappings import (
    NO_BIASES,
    TRAINING_ONLY,
    _check_no_biases,
    _experts,
    _shared_width_fields,
)
from blockzoo_moe.huggingface.deepseek_v3 import _grouped_sigmoid_router, _routed_experts


def _import_nemotron_shared(data: Mapping[str, Any]) -> dict[str, Any]:
    width, expert = data.get("moe_shared_expert_intermediate_size", 7688), data.get("moe_intermediate_size", 7688)
    return _shared_width_fields("moe_shared_expert_intermediate_size", width, expert)


def _export_nemotron_shared(config: MoEMLPConfig) -> dict[str, Any]:
    if not config.shared_experts:
        raise ConversionError("shared_experts = 0: NemotronH has shared experts in every MoE layer")
    return {"moe_shared_expert_intermediate_size": config.shared_width}


def _import_nemotron_biases(data: Mapping[str, Any]) -> dict[str, Any]:
    if data.get("mlp_bias", False):
        raise ConversionError(
            "`mlp_bias` = true with MoE layers: NemotronH's shared experts then have biases and its routed experts "
            "none, which blockzoo's moe cannot express (both or neither)"
        )
    return {}


def _export_nemotron_biases(config: MoEMLPConfig) -> dict[str, Any]:
    _check_no_biases(config)
    return {"mlp_bias": False}


# NemotronH's MoE layers (`E`): ungated experts, shared experts of their own width, a sigmoid router choosing among
# its best groups with a correction bias (DeepSeek-V3's). `layers.N.mixer.{gate,experts.E,shared_experts}`.
NEMOTRON_H = Section(
    config_class=MoEMLPConfig,
    name="mixer",
    config=(
        # The defaults: transformers' NemotronHConfig.
        *_routed_experts(experts=8, per_token=2, intermediate_size=7688),
        Computed(
            ("shared_experts", "shared_intermediate_size"),
            ("moe_shared_expert_intermediate_size",),
            import_=_import_nemotron_shared,
            export=_export_nemotron_shared,
        ),
        Constant("shared_expert_gate", None),
        Constant("gated", False),
        format_activation("mlp_hidden_act"),
        Computed(NO_BIASES.ours, ("mlp_bias",), import_=_import_nemotron_biases, export=_export_nemotron_biases),
        *_grouped_sigmoid_router(scale=1.0, groups=1, groups_per_token=1),
        Fixed("moe_latent_size", None),
        Ignored(
            theirs=("n_shared_experts", "moe_shared_expert_overlap"),
            reason="unread by transformers (the shared width is moe_shared_expert_intermediate_size) and a "
            "scheduling option",
        ),
        Ignored(
            ours=("auxiliary_loss_coefficient", "router_jitter"),
            reason="training settings; NemotronH stores none (its correction bias balances the experts)",
        ),
        TRAINING_ONLY,
    ),
    weights=lambda config: [
        Weight("router.weight", "gate.weight"),
        Weight("score_correction_bias", "gate.e_score_correction_bias"),
        Concatenated("gate_up.weight", _experts("experts.{}.up_proj.weight", config.experts)),
        Concatenated("down.weight", _experts("experts.{}.down_proj.weight", config.experts), transposed=True),
        Weight("shared_gate_up.weight", "shared_experts.up_proj.weight"),
        Weight("shared_down.weight", "shared_experts.down_proj.weight"),
    ],
)
