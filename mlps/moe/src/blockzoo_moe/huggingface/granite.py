"""Granite-4.0 hybrid's MoE section (`granitemoehybrid`): fused expert tensors and an ungated shared MLP."""

from __future__ import annotations

from typing import Any

from blockzoo.api import (
    Computed,
    ComputedWeights,
    Constant,
    ConversionError,
    Ignored,
    Rename,
    Section,
    Weight,
    WeightMapping,
    format_activation,
)
from blockzoo_moe.config import MoEMLPConfig
from blockzoo_moe.huggingface.common_mappings import (
    NO_BIASES,
    SOFTMAX_ROUTER,
    TRAINING_ONLY,
    _shared_width_fields,
    routing,
)


def _granite_weights(config: MoEMLPConfig) -> list[WeightMapping]:
    """Granite's experts of a projection are one tensor `[experts, rows, hidden]` (gate‖up per expert, the gate
    first), and the shared MLP (`shared_mlp`, beside `block_sparse_moe`) one gate‖up; blockzoo's rows are
    expert-major per projection (every expert's gate, then every expert's up), down transposed."""
    experts, width = config.experts, config.intermediate_size

    def import_gate_up(tensors: list[Any]) -> list[Any]:
        fused = tensors[0].unflatten(1, (2, width))  # [experts, gate|up, width, hidden]
        return [fused.transpose(0, 1).flatten(0, 2)]

    def export_gate_up(tensors: list[Any]) -> list[Any]:
        ours = tensors[0].unflatten(0, (2, experts, width))
        return [ours.transpose(0, 1).flatten(1, 2).contiguous()]

    return [
        Weight("router.weight", "block_sparse_moe.router.layer.weight"),
        ComputedWeights(
            ("gate_up.weight",),
            ("block_sparse_moe.input_linear.weight",),
            import_=import_gate_up,
            export=export_gate_up,
        ),
        ComputedWeights(
            ("down.weight",),
            ("block_sparse_moe.output_linear.weight",),
            import_=lambda tensors: [tensors[0].transpose(1, 2).flatten(0, 1)],
            export=lambda tensors: [tensors[0].unflatten(0, (experts, width)).transpose(1, 2).contiguous()],
        ),
        Weight("shared_gate_up.weight", "shared_mlp.input_linear.weight"),
        Weight("shared_down.weight", "shared_mlp.output_linear.weight"),
    ]


def _export_granite_shared(config: MoEMLPConfig) -> dict[str, Any]:
    if not config.shared_experts or config.shared_expert_gate is not None:
        raise ConversionError(
            f"shared_experts = {config.shared_experts}, shared_expert_gate = {config.shared_expert_gate}: Granite has "
            "one ungated shared MLP in every layer"
        )
    return {"shared_intermediate_size": config.shared_width}


# Granite-4.0 hybrid (`granitemoehybrid`): softmax over the top-k router logits (the renormalized top k of the
# softmax), a shared MLP of its own width (`shared_intermediate_size`) beside the experts, both gated.
GRANITE = Section(
    config_class=MoEMLPConfig,
    name=None,
    config=(
        Rename("experts", "num_local_experts"),
        Rename("experts_per_token", "num_experts_per_tok"),
        Computed(
            ("shared_experts", "shared_intermediate_size"),
            ("shared_intermediate_size",),
            import_=lambda data: _shared_width_fields(
                "shared_intermediate_size", data.get("shared_intermediate_size", 1024), data["intermediate_size"]
            ),
            export=_export_granite_shared,
        ),
        Constant("shared_expert_gate", None),
        Rename("intermediate_size", "intermediate_size"),
        Constant("gated", True),
        format_activation("hidden_act"),
        NO_BIASES,
        routing(None),
        # GraniteMoeHybridConfig's router: Mixtral's, its auxiliary loss coefficient 0.001 by default.
        *SOFTMAX_ROUTER,
        Rename("auxiliary_loss_coefficient", "router_aux_loss_coef", default=0.001),
        Ignored(ours=("router_jitter",), theirs=("output_router_logits",), reason="training and output options"),
        TRAINING_ONLY,
    ),
    weights=_granite_weights,
)
