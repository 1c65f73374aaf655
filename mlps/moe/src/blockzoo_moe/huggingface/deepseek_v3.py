"""DeepSeek-V3's MoE section (`mlp`) and the keys of its routed experts and grouped sigmoid router, which NemotronH
shares."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from blockzoo.api import (
    Computed,
    Concatenated,
    ConfigMapping,
    Constant,
    ConversionError,
    Ignored,
    Rename,
    Section,
    Weight,
    format_activation,
)
from blockzoo_moe.config import MoEMLPConfig
from blockzoo_moe.huggingface.common_mappings import NO_BIASES, TRAINING_ONLY, _experts


def _routed_experts(*, experts: int, per_token: int, intermediate_size: int) -> tuple[ConfigMapping, ...]:
    """The routed experts under DeepSeek-V3's keys (NemotronH's too), with the format's defaults."""
    return (
        Rename("experts", "n_routed_experts", default=experts),
        Rename("experts_per_token", "num_experts_per_tok", default=per_token),
        Rename("intermediate_size", "moe_intermediate_size", default=intermediate_size),
    )


def _grouped_sigmoid_router(*, scale: float, groups: int, groups_per_token: int) -> tuple[ConfigMapping, ...]:
    """DeepSeek-V3's router (NemotronH's too): sigmoid scores, each token's experts chosen among its best groups with
    a correction bias, the weights scaled; the defaults are the format's."""
    return (
        Constant("routing", "sigmoid_top_k"),
        Rename("norm_topk_prob", "norm_topk_prob", default=True),
        Rename("routed_scale", "routed_scaling_factor", default=scale),
        Rename("routing_groups", "n_group", default=groups),
        Rename("routing_groups_per_token", "topk_group", default=groups_per_token),
        Constant("score_correction_bias", True),
    )


def _import_deepseek_shared(data: Mapping[str, Any]) -> dict[str, Any]:
    count = data.get("n_shared_experts", 1)
    if not isinstance(count, int) or count < 1:
        raise ConversionError(f"`n_shared_experts` = {count!r}: DeepSeek-V3's MoE layers have at least one")
    return {"shared_experts": count, "shared_intermediate_size": None}


def _export_deepseek_shared(config: MoEMLPConfig) -> dict[str, Any]:
    width, expert = config.shared_width, config.intermediate_size
    if not width or width % expert:
        raise ConversionError(
            f"shared experts of width {width} cannot be written: DeepSeek-V3's shared MLP is n_shared_experts ≥ 1 "
            f"routed experts wide ({expert} each)"
        )
    return {"n_shared_experts": width // expert}


# DeepSeek-V3: gated experts, shared experts n_shared_experts routed experts wide, the sigmoid router choosing among
# its best groups with a correction bias. `layers.N.mlp.{gate,experts.E,shared_experts}`.
DEEPSEEK_V3 = Section(
    config_class=MoEMLPConfig,
    name="mlp",
    config=(
        # The defaults: transformers' DeepseekV3Config.
        *_routed_experts(experts=256, per_token=8, intermediate_size=2048),
        Computed(
            ("shared_experts", "shared_intermediate_size"),
            ("n_shared_experts",),
            import_=_import_deepseek_shared,
            export=_export_deepseek_shared,
        ),
        Constant("shared_expert_gate", None),
        Constant("gated", True),
        format_activation("hidden_act"),
        NO_BIASES,
        *_grouped_sigmoid_router(scale=2.5, groups=8, groups_per_token=4),
        Ignored(
            ours=("auxiliary_loss_coefficient", "router_jitter"),
            theirs=("output_router_logits",),
            reason="training and output options; DeepSeek-V3 stores none (its correction bias balances the experts)",
        ),
        TRAINING_ONLY,
    ),
    weights=lambda config: [
        Weight("router.weight", "gate.weight"),
        Weight("score_correction_bias", "gate.e_score_correction_bias"),
        Concatenated(
            "gate_up.weight",
            _experts("experts.{}.gate_proj.weight", config.experts)
            + _experts("experts.{}.up_proj.weight", config.experts),
        ),
        Concatenated("down.weight", _experts("experts.{}.down_proj.weight", config.experts), transposed=True),
        Concatenated("shared_gate_up.weight", ("shared_experts.gate_proj.weight", "shared_experts.up_proj.weight")),
        Weight("shared_down.weight", "shared_experts.down_proj.weight"),
    ],
)
