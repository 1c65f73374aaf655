"""The mappings every MoE family shares: the expert names, no biases, the softmax router and its routing, the
training-only settings, the per-expert weight mappings, and the shared experts' fields for a shared MLP width."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from blockzoo.api import (
    Computed,
    Concatenated,
    ConfigMapping,
    Constant,
    ConversionError,
    Ignored,
    Weight,
    WeightMapping,
)
from blockzoo_moe.config import MoEMLPConfig


def _experts(template: str, count: int) -> tuple[str, ...]:
    return tuple(template.format(expert) for expert in range(count))


def _check_no_biases(config: MoEMLPConfig) -> dict[str, Any]:
    found = {role: config.has_bias(getattr(config, role)) for role in ("gate", "up", "down")}
    found["router"] = bool(config.router.bias.enabled)
    if config.shared_expert_gate is not None:
        found["shared_expert_gate"] = bool(config.shared_expert_gate.bias.enabled)
    if any(found.values()):
        raise ConversionError(f"MoE biases {found} cannot be written: the format's experts and router have none")
    return {}


NO_BIASES = Computed(
    (
        "add_linear_biases",
        "gate.bias.enabled",
        "up.bias.enabled",
        "down.bias.enabled",
        "router.bias.enabled",
        "shared_expert_gate.bias.enabled",
    ),
    (),
    export=_check_no_biases,
)


def _normalized(config: MoEMLPConfig) -> bool:
    """Whether the selected experts' scores sum to 1 (top_k_softmax always does)."""
    return config.routing == "top_k_softmax" or config.norm_topk_prob


def _check_softmax(config: MoEMLPConfig) -> None:
    if config.routing == "sigmoid_top_k":
        raise ConversionError("routing sigmoid_top_k cannot be written: this format's router is a softmax")


# The router of the softmax formats: no group-limited choice, no correction bias, no scaling.
SOFTMAX_ROUTER = (
    Constant("routed_scale", 1.0),
    Constant("routing_groups", 1),
    Constant("routing_groups_per_token", 1),
    Constant("score_correction_bias", False),
)


def routing(theirs: str | None) -> ConfigMapping:
    """softmax over all experts, top k, renormalized if `theirs` (default false) or always (`theirs` None)."""

    def import_(data: Mapping[str, Any]) -> dict[str, Any]:
        return {"routing": "softmax_top_k", "norm_topk_prob": bool(data.get(theirs, False)) if theirs else True}

    def export(config: MoEMLPConfig) -> dict[str, Any]:
        _check_softmax(config)
        if theirs is None and not _normalized(config):
            raise ConversionError("routing without renormalization cannot be written: this format always renormalizes")
        return {theirs: _normalized(config)} if theirs else {}

    return Computed(("routing", "norm_topk_prob"), (theirs,) if theirs else (), import_=import_, export=export)


TRAINING_ONLY = Ignored(
    ours=("z_loss_coefficient", "expert_parallel"), reason="training settings; the format stores neither"
)


def _weights(names: dict[str, str]) -> Callable[[MoEMLPConfig], list[WeightMapping]]:
    """Weight mappings; `names`: the format's names of the router and each expert projection (`{}`: the expert)."""

    def weights(config: MoEMLPConfig) -> list[WeightMapping]:
        experts = config.experts
        mappings: list[WeightMapping] = [
            Weight("router.weight", names["router"]),
            Concatenated("gate_up.weight", _experts(names["gate"], experts) + _experts(names["up"], experts)),
            Concatenated("down.weight", _experts(names["down"], experts), transposed=True),
        ]
        if config.shared_experts:
            mappings += [
                Concatenated(
                    "shared_gate_up.weight", ("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight")
                ),
                Weight("shared_down.weight", "shared_expert.down_proj.weight"),
            ]
        if config.shared_expert_gate is not None:
            mappings.append(Weight("shared_expert_gate.weight", "shared_expert_gate.weight"))
        return mappings

    return weights


def _shared_width_fields(key: str, width: int, expert: int) -> dict[str, Any]:
    """Our shared experts for a shared MLP of `width`: whole experts of the routed width when it is a multiple of it,
    else one MLP of its own width."""
    if width <= 0:
        raise ConversionError(f"`{key}` = {width}: the shared experts need a positive width")
    if width % expert == 0:
        return {"shared_experts": width // expert, "shared_intermediate_size": None}
    return {"shared_experts": 1, "shared_intermediate_size": width}
