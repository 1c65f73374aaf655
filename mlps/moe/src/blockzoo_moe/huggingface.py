"""How the mixture of experts is written in the Hugging Face formats (converter sections, see `blockzoo.conversion`).

On disk every format keeps one tensor per expert and projection (transformers 5 fuses them in memory only), so
the files load in transformers 4.x and 5.x: Mixtral `block_sparse_moe.experts.E.{w1,w3,w2}` (gate, up, down),
Qwen-MoE `mlp.experts.E.{gate,up,down}_proj`, the router `gate`. blockzoo holds the experts of a projection as one
tensor, rows expert-major (gate‖up: every expert's gate, then every expert's up; down transposed). Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from blockzoo.api import (
    Computed,
    ComputedWeights,
    Concatenated,
    ConfigMapping,
    Constant,
    ConversionError,
    Fixed,
    Ignored,
    Rename,
    Section,
    Weight,
    WeightMapping,
    format_activation,
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


MIXTRAL = Section(
    config_class=MoEMLPConfig,
    name="block_sparse_moe",
    config=(
        Rename("experts", "num_local_experts"),
        Rename("experts_per_token", "num_experts_per_tok"),
        Constant("shared_experts", 0),
        Constant("shared_expert_gate", None),
        Constant("shared_intermediate_size", None),
        Rename("intermediate_size", "intermediate_size"),
        Constant("gated", True),
        format_activation("hidden_act"),
        NO_BIASES,
        routing(None),
        *SOFTMAX_ROUTER,
        Rename("auxiliary_loss_coefficient", "router_aux_loss_coef", default=0.001),
        # transformers also jitters the experts' input, blockzoo only the router's: training only either way.
        Rename("router_jitter", "router_jitter_noise", default=0.0),
        Ignored(theirs=("output_router_logits",), reason="an output option of transformers"),
        TRAINING_ONLY,
    ),
    weights=_weights(
        {
            "router": "gate.weight",
            "gate": "experts.{}.w1.weight",
            "up": "experts.{}.w3.weight",
            "down": "experts.{}.w2.weight",
        }
    ),
)

_QWEN_NAMES = {
    "router": "gate.weight",
    "gate": "experts.{}.gate_proj.weight",
    "up": "experts.{}.up_proj.weight",
    "down": "experts.{}.down_proj.weight",
}


def _shared_width_fields(key: str, width: int, expert: int) -> dict[str, Any]:
    """Our shared experts for a shared MLP of `width`: whole experts of the routed width when it is a multiple of it,
    else one MLP of its own width."""
    if width <= 0:
        raise ConversionError(f"`{key}` = {width}: the shared experts need a positive width")
    if width % expert == 0:
        return {"shared_experts": width // expert, "shared_intermediate_size": None}
    return {"shared_experts": 1, "shared_intermediate_size": width}


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


def _export_unnormalized(config: MoEMLPConfig) -> dict[str, Any]:
    _check_softmax(config)
    if _normalized(config):
        raise ConversionError("renormalized routing cannot be written: Jamba never renormalizes the top-k scores")
    return {}


# Jamba: softmax over all experts, top k, never renormalized; `feed_forward.router`, `experts.E.{gate,up,down}_proj`.
JAMBA = Section(
    config_class=MoEMLPConfig,
    name="feed_forward",
    config=(
        Rename("experts", "num_experts"),
        Rename("experts_per_token", "num_experts_per_tok"),
        Constant("shared_experts", 0),
        Constant("shared_expert_gate", None),
        Constant("shared_intermediate_size", None),
        Rename("intermediate_size", "intermediate_size"),
        Constant("gated", True),
        format_activation("hidden_act"),
        NO_BIASES,
        Computed(
            ("routing", "norm_topk_prob"),
            (),
            import_=lambda data: {"routing": "softmax_top_k", "norm_topk_prob": False},
            export=_export_unnormalized,
        ),
        *SOFTMAX_ROUTER,
        Rename("auxiliary_loss_coefficient", "router_aux_loss_coef", default=0.001),
        Ignored(ours=("router_jitter",), theirs=("output_router_logits",), reason="training and output options"),
        TRAINING_ONLY,
    ),
    weights=_weights({**_QWEN_NAMES, "router": "router.weight"}),
)


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
        # RECONSTRUCTED (blockzoo-mla helper): the lines from here to the end of GRANITE were lost by an editing
        # mistake and written again by analogy with MIXTRAL; the granitemoehybrid author should check them.
        *SOFTMAX_ROUTER,
        Rename("auxiliary_loss_coefficient", "router_aux_loss_coef", default=0.001),
        Ignored(ours=("router_jitter",), theirs=("output_router_logits",), reason="training and output options"),
        TRAINING_ONLY,
    ),
    weights=_granite_weights,
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


def register_sections(register: Callable[[str, Section], None]) -> None:
    """The MoE section of every Hugging Face MoE format."""
    register("mixtral", MIXTRAL)
    register("qwen2_moe", _qwen_section(shared=True, experts_key="num_experts"))
    # `num_experts`: read by transformers 4.x and (through its attribute map) 5.x.
    register("qwen3_moe", _qwen_section(shared=False, experts_key="num_experts"))
    register("qwen3_next", _qwen_section(shared=True, experts_key="num_experts"))  # Qwen2-MoE's gated shared expert
    register("jamba", JAMBA)
    register("nemotron_h", NEMOTRON_H)
    register("granitemoehybrid", GRANITE)
    register("deepseek_v3", DEEPSEEK_V3)
