"""Config of the dense MLP (`type: mlp`). Torch-free, like every plugin's config module."""

from __future__ import annotations

from typing import ClassVar

import attrs

from blockzoo.api import (
    GENERATION_CACHE,
    SEQUENCE_DATA_PARALLEL,
    SEQUENCE_TENSOR_PARALLEL,
    TENSOR_PARALLEL,
    Activation,
    LinearConfig,
    MLPConfig,
    at_least,
    check,
    configclass,
    default_activation,
    field,
)


@configclass
class DenseMLPConfig(MLPConfig):
    """down(activation(gate(x)) · up(x)) when gated, else down(activation(up(x))).

    The gate and up projections are one fused weight (gate‖up, gate rows first), split over the
    intermediate dim between tensor-parallel ranks; each part keeps its own `LinearConfig`.
    """

    capabilities: ClassVar[frozenset[str]] = frozenset(
        {TENSOR_PARALLEL, SEQUENCE_TENSOR_PARALLEL, SEQUENCE_DATA_PARALLEL, GENERATION_CACHE}
    )

    intermediate_size: int = field(4096, doc="Width of the hidden layer.", validator=at_least(1))
    gated: bool = field(False, doc="Multiply the activation by a second (gate) projection (SwiGLU, GeGLU).")
    activation: Activation = field(
        attrs.Factory(default_activation, takes_self=True),
        doc="silu, gelu (exact, erf-based), relu, squared_relu (relu²) or identity. Default: silu if gated, else gelu.",
    )
    gate: LinearConfig = field(
        factory=LinearConfig, doc="The gate projection (gated MLPs only): the activation's input."
    )
    up: LinearConfig = field(factory=LinearConfig, doc="The up projection (multiplied by the activated gate if gated).")
    down: LinearConfig = field(factory=LinearConfig, doc="The down projection, back to the hidden size.")
    add_linear_biases: bool = field(False, doc="Default of every projection's `bias.enabled`.")
    gate_multiplier: float = field(
        1.0,
        doc="Scales the gate projection's output, the activation's input (Falcon-H1's gate multiplier); gated only.",
    )
    down_multiplier: float = field(1.0, doc="Scales the down projection's output (Falcon-H1's down multiplier).")
    lr_scale: float | None = field(
        None, doc="Multiplies the parent's learning-rate scale; 0 freezes.", validator=at_least(0)
    )

    def __attrs_post_init__(self) -> None:
        check(
            self.gated or self.gate == LinearConfig(),
            "gate",
            "only a gated MLP has a gate projection; set `gated: true` or remove `gate`",
        )
        check(
            self.gated or self.gate_multiplier == 1,
            "gate_multiplier",
            "only a gated MLP has a gate projection; set `gated: true` or remove `gate_multiplier`",
        )
        if self.gated:
            check(
                self.has_bias(self.gate) == self.has_bias(self.up),
                "up.bias.enabled",
                f"gate and up are one fused weight: both have a bias or neither (gate bias: {self.has_bias(self.gate)},"
                f" up bias: {self.has_bias(self.up)})",
            )

    def check_tensor_parallel(self, tensor_parallel: int) -> None:
        check(
            self.intermediate_size % tensor_parallel == 0,
            "intermediate_size",
            f"tensor_parallel={tensor_parallel} must divide it ({self.intermediate_size})",
        )

    def has_bias(self, linear: LinearConfig) -> bool:
        return self.add_linear_biases if linear.bias.enabled is None else linear.bias.enabled
