"""Config of the mixture-of-experts MLP (`type: moe`). Torch-free, like every plugin's config module."""

from __future__ import annotations

from typing import ClassVar, Literal

import attrs

from blockzoo.api import (
    GENERATION_CACHE,
    SEQUENCE_DATA_PARALLEL,
    TENSOR_PARALLEL,
    Activation,
    LinearConfig,
    MLPConfig,
    at_least,
    check,
    configclass,
    default_activation,
    field,
    greater_than,
)

Routing = Literal["softmax_top_k", "top_k_softmax", "sigmoid_top_k"]

# Experts split between the data-parallel ranks, tokens exchanged with all-to-all (`expert_parallel: true`).
EXPERT_PARALLEL = "expert_parallel"


@configclass
class MoEMLPConfig(MLPConfig):
    """A router picks `experts_per_token` of `experts` MLPs for each token; their outputs are summed, weighted by
    the routing scores, plus `shared_experts` MLPs every token goes through. Dropless: every token reaches its
    experts.

    The experts' projections are one tensor each (gate‖up of all experts, down of all experts), split over the
    intermediate dim between tensor-parallel ranks; gate, up and down keep their own `LinearConfig`.
    """

    # Not sequence-tensor-parallel: the load-balancing statistics are means over all the tokens of the batch, which
    # a token-split rank does not see. Sequence-data-parallel: the statistics are summed over the slices first.
    capabilities: ClassVar[frozenset[str]] = frozenset(
        {TENSOR_PARALLEL, SEQUENCE_DATA_PARALLEL, GENERATION_CACHE, EXPERT_PARALLEL}
    )

    experts: int = field(8, doc="Number of routed experts.", validator=at_least(1))
    experts_per_token: int = field(2, doc="Routed experts each token goes through (top-k).", validator=at_least(1))
    shared_experts: int = field(
        0,
        doc="Experts every token goes through, unweighted (Qwen2-MoE, DeepSeek). Stored as one MLP of width "
        "shared_experts · intermediate_size (or `shared_intermediate_size`).",
        validator=at_least(0),
    )
    shared_intermediate_size: int | None = field(
        None,
        doc="Width of the hidden layer of the shared MLP (all shared experts as one), any width: Qwen2-MoE's "
        "`shared_expert_intermediate_size`, NemotronH's `moe_shared_expert_intermediate_size`. None: "
        "shared_experts · intermediate_size. Needs shared_experts >= 1.",
        validator=at_least(1),
    )
    shared_expert_gate: LinearConfig | None = field(
        None,
        doc="If set (`{}` for the defaults), the shared experts' output is scaled by sigmoid(linear(x)), a scalar per "
        "token (Qwen2-MoE's `shared_expert_gate`). Needs shared_experts >= 1. No bias unless `bias.enabled`.",
    )
    intermediate_size: int = field(4096, doc="Width of the hidden layer of each expert.", validator=at_least(1))
    gated: bool = field(True, doc="Experts multiply the activation by a second (gate) projection (SwiGLU).")
    activation: Activation = field(
        attrs.Factory(default_activation, takes_self=True),
        doc="silu, gelu (exact, erf-based), relu, squared_relu (relu²) or identity. Default: silu if gated, else gelu.",
    )
    router: LinearConfig = field(
        factory=LinearConfig,
        doc="The router, hidden -> experts logits. Its own initialization and lr_scale; no bias unless "
        "`bias.enabled` (`add_linear_biases` does not apply to it).",
    )
    gate: LinearConfig = field(
        factory=LinearConfig,
        doc="The experts' gate projection (gated only). `apply_peft` adapts the shared experts' only: routed experts "
        "take no PEFT adapters.",
    )
    up: LinearConfig = field(
        factory=LinearConfig,
        doc="The experts' up projection. `apply_peft` adapts the shared experts' only: routed experts take no PEFT "
        "adapters.",
    )
    down: LinearConfig = field(
        factory=LinearConfig,
        doc="The experts' down projection, back to the hidden size. `apply_peft` adapts the shared experts' only: "
        "routed experts take no PEFT adapters.",
    )
    add_linear_biases: bool = field(False, doc="Default `bias.enabled` of the expert (and shared-expert) projections.")
    routing: Routing = field(
        "softmax_top_k",
        doc="softmax_top_k: softmax over all experts, then the top k (Mixtral, Qwen-MoE). top_k_softmax: the top k "
        "logits, then a softmax over them (always sums to 1; equal to softmax_top_k with norm_topk_prob up to "
        "rounding). sigmoid_top_k: a sigmoid of each logit, the top k (DeepSeek-V3, NemotronH).",
    )
    norm_topk_prob: bool = field(
        True,
        doc="softmax_top_k and sigmoid_top_k: rescale the selected scores to sum to 1 (Mixtral: true; Qwen-MoE: "
        "false).",
    )
    routed_scale: float = field(
        1.0,
        doc="Multiplies the selected experts' scores (DeepSeek-V3's and NemotronH's routed_scaling_factor).",
        validator=greater_than(0),
    )
    routing_groups: int = field(
        1,
        doc="sigmoid_top_k only: the experts form this many groups of consecutive experts, and a token chooses among "
        "the experts of its `routing_groups_per_token` best groups, a group scored by the sum of its two highest "
        "scores (DeepSeek-V3's n_group).",
        validator=at_least(1),
    )
    routing_groups_per_token: int = field(
        1, doc="sigmoid_top_k only: how many groups a token chooses from (topk_group).", validator=at_least(1)
    )
    score_correction_bias: bool = field(
        False,
        doc="sigmoid_top_k only: a per-expert bias added to the scores to choose the experts, not to weight them "
        "(DeepSeek-V3's e_score_correction_bias). A frozen parameter, zero or from a checkpoint: its auxiliary-loss-"
        "free update is not implemented.",
    )
    auxiliary_loss_coefficient: float = field(
        0.01,
        doc="Weight of the load-balancing loss experts · Σ_e (fraction of routings to e) · (mean probability of e), "
        "added as `<layer>.load_balancing` (Switch, Mixtral).",
        validator=at_least(0),
    )
    z_loss_coefficient: float = field(
        0.0,
        doc="Weight of the router z-loss mean(logsumexp(logits)²), added as `<layer>.router_z_loss`.",
        validator=at_least(0),
    )
    router_jitter: float = field(
        0.0,
        doc="Training only: the router's input is multiplied by noise uniform in [1 - jitter, 1 + jitter] (Mixtral's "
        "router_jitter_noise). The experts see the clean input.",
        validator=at_least(0),
    )
    expert_parallel: bool = field(
        False,
        doc="Split the experts between the data-parallel ranks (rank r holds experts [r·E/dp, (r+1)·E/dp)); each "
        "rank routes its own tokens and sends each (token, expert) pair to the rank holding the expert with an "
        "all-to-all. experts must divide by the data-parallel size.",
    )
    lr_scale: float | None = field(
        None, doc="Multiplies the parent's learning-rate scale; 0 freezes.", validator=at_least(0)
    )

    def __attrs_post_init__(self) -> None:
        check(
            self.experts_per_token <= self.experts,
            "experts_per_token",
            f"must be <= experts ({self.experts}), got {self.experts_per_token}",
        )
        check(
            self.gated or self.gate == LinearConfig(),
            "gate",
            "only gated experts have a gate projection; set `gated: true` or remove `gate`",
        )
        check(
            self.shared_expert_gate is None or self.shared_experts > 0,
            "shared_expert_gate",
            "gates the shared experts, but shared_experts is 0",
        )
        check(
            self.shared_intermediate_size is None or self.shared_experts > 0,
            "shared_intermediate_size",
            "sets the width of the shared experts, but shared_experts is 0",
        )
        check(
            self.routing != "top_k_softmax" or self.norm_topk_prob,
            "norm_topk_prob",
            "routing top_k_softmax always sums to 1 over the selected experts; use routing softmax_top_k",
        )
        defaults = attrs.fields_dict(type(self))
        for name in ("routing_groups", "routing_groups_per_token", "score_correction_bias"):
            unchanged = getattr(self, name) == defaults[name].default
            check(unchanged or self.routing == "sigmoid_top_k", name, "needs routing sigmoid_top_k")
        check(
            self.experts % self.routing_groups == 0,
            "routing_groups",
            f"must divide the experts ({self.experts}), got {self.routing_groups}",
        )
        check(
            self.routing_groups == 1 or self.experts // self.routing_groups >= 2,
            "routing_groups",
            "a group is scored by its two highest scores: each needs at least 2 experts",
        )
        check(
            self.routing_groups_per_token <= self.routing_groups,
            "routing_groups_per_token",
            f"must be <= routing_groups ({self.routing_groups}), got {self.routing_groups_per_token}",
        )
        check(
            self.experts_per_token <= self.routing_groups_per_token * self.experts // self.routing_groups,
            "experts_per_token",
            f"must be <= the experts of the {self.routing_groups_per_token} groups a token chooses from",
        )
        check(
            self.router_jitter < 1,
            "router_jitter",
            f"must be < 1 (a noise factor in [1 - jitter, 1 + jitter]), got {self.router_jitter}",
        )
        for part in ("gate", "up", "down"):
            # The routed experts' projections are no `Linear` (one tensor of all experts): no adapter of theirs.
            check(
                getattr(self, part).apply_peft is not True or self.shared_experts > 0,
                f"{part}.apply_peft",
                "routed experts take no PEFT adapters, only the shared experts' projections do, and this MoE has no "
                "shared experts (shared_experts: 0)",
            )
        if self.gated:
            check(
                self.has_bias(self.gate) == self.has_bias(self.up),
                "up.bias.enabled",
                f"gate and up are one fused weight: both have a bias or neither (gate bias: {self.has_bias(self.gate)},"
                f" up bias: {self.has_bias(self.up)})",
            )

    @property
    def group_size(self) -> int:
        return self.experts // self.routing_groups

    @property
    def shared_width(self) -> int:
        """The hidden width of the shared MLP (0 without shared experts)."""
        if not self.shared_experts:
            return 0
        if self.shared_intermediate_size is not None:
            return self.shared_intermediate_size
        return self.shared_experts * self.intermediate_size

    def check_expert_parallel(self, data_parallel: int, tensor_parallel: int) -> None:
        """Raise if the experts cannot be split between `data_parallel` ranks (with `expert_parallel`)."""
        if not self.expert_parallel:
            return
        check(
            self.experts % data_parallel == 0,
            "experts",
            f"expert_parallel splits the experts between the {data_parallel} data-parallel ranks: it must divide "
            f"the number of experts ({self.experts})",
        )
        check(
            tensor_parallel == 1 or not self.has_bias(self.down),
            "down.bias.enabled",
            "expert_parallel with tensor_parallel > 1 does not support a down-projection bias",
        )

    def check_tensor_parallel(self, tensor_parallel: int) -> None:
        check(
            self.intermediate_size % tensor_parallel == 0,
            "intermediate_size",
            f"tensor_parallel={tensor_parallel} must divide it ({self.intermediate_size})",
        )
        check(
            self.shared_width % tensor_parallel == 0,
            "shared_intermediate_size",
            f"tensor_parallel={tensor_parallel} must divide the shared experts' width ({self.shared_width})",
        )

    def has_bias(self, linear: LinearConfig) -> bool:
        return self.add_linear_biases if linear.bias.enabled is None else linear.bias.enabled
