"""The Qwen MoE sections (`mlp`): Qwen2-MoE and Qwen3-Next with their gated shared expert, Qwen3-MoE without."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from blockzoo.api import (
    Computed,
    Constant,
    ConversionError,
    Ignored,
    Rename,
    Section,
    format_activation,
)
from blockzoo_moe.config import MoEMLPConfig
from blockzoo_moe.huggingface.common_mappings import (
    NO_BIASES,
    SOFTMAX_ROUTER,
    TRAINING_ONLY,
    _shared_width_fields,
    _weights,
    routing,
)

_QWEN_NAMES = {
    "router": "gate.weight",
    "gate": "experts.{}.gate_proj.weight",
    "up": "experts.{}.up_proj.weight",
    "down": "experts.{}.down_proj.weight",
}


def _import_shared(data: Mapping[str, Any]) -> dict[str, Any]:
    width, expert = data.get("shared_expert_intermediate_size", 5632), data["moe_intermediate_size"]
    return {**_shared_width_fields("shared_expert_intermediate_size", width, expert), "shared_expert_gate": {}}


def _export_shared(config: MoEMLPConfig) -> dict[str, Any]:
    if not config.shared_experts or config.shared_expert_gate is None:
        raise ConversionError(
            f"shared_experts = {config.shared_experts}, shared_expert_gate = {config.shared_expert_gate}: Qwen2-MoE "
            "has gated shared experts in every MoE layer"
        )
    return {"shared_expert_intermediate_size": config.shared_width}


def _qwen_section(*, shared: bool, experts_key: str) -> Section:
    shared_mappings = (
        (
            Computed(
                ("shared_experts", "shared_expert_gate", "shared_intermediate_size"),
                ("shared_expert_intermediate_size",),
                import_=_import_shared,
                export=_export_shared,
            ),
        )
        if shared
        else (
            Constant("shared_experts", 0),
            Constant("shared_expert_gate", None),
            Constant("shared_intermediate_size", None),
        )
    )
    return Section(
        config_class=MoEMLPConfig,
        name="mlp",
        config=(
            Computed(
                ("experts",),
                ("num_experts", "num_local_experts"),
                import_=_import_qwen_experts,
                export=lambda config: {experts_key: config.experts},
            ),
            Rename("experts_per_token", "num_experts_per_tok"),
            *shared_mappings,
            Rename("intermediate_size", "moe_intermediate_size"),
            Constant("gated", True),
            format_activation("hidden_act"),
            NO_BIASES,
            routing("norm_topk_prob"),
            *SOFTMAX_ROUTER,
            Rename("auxiliary_loss_coefficient", "router_aux_loss_coef", default=0.001),
            Ignored(ours=("router_jitter",), theirs=("output_router_logits",), reason="training and output options"),
            TRAINING_ONLY,
        ),
        weights=_weights(_QWEN_NAMES),
    )


def _import_qwen_experts(data: Mapping[str, Any]) -> dict[str, Any]:
    # transformers 5 writes Qwen3-MoE's `num_local_experts`, 4.x `num_experts` (which 5 still reads).
    found = {key: data[key] for key in ("num_experts", "num_local_experts") if key in data}
    if len(set(found.values())) > 1:
        raise ConversionError(f"`num_experts` and `num_local_experts` disagree: {found}")
    if not found:
        raise ConversionError("`num_experts` is missing from the config")
    return {"experts": next(iter(found.values()))}
