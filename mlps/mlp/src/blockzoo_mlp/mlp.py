"""The dense MLP: a column-parallel fused gate‖up projection, an activation, a row-parallel down projection.

Tensor-parallel ranks each hold a slice of the intermediate dim (of the gate and of the up parts
alike), so the activation and the gating need no communication; the down projection sums the
partial outputs (all-reduce, or reduce-scatter along tokens under sequence-tensor-parallel). Each
token is transformed on its own, so any split of the tokens (sequence-data-parallel, generation)
works unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from blockzoo.api import (
    ACTIVATIONS,
    MLP,
    Batch,
    ConcatenatedTensorDim,
    Distributed,
    Linear,
    NormalInitializationConfig,
    TensorDim,
    scaled_lr,
)
from blockzoo_mlp.config import DenseMLPConfig


class DenseMLP(MLP):
    def __init__(
        self, config: DenseMLPConfig, *, name: str, hidden_dim: TensorDim, distributed: Distributed, lr_scale: float
    ):
        lr_scale = scaled_lr(lr_scale, config.lr_scale)
        super().__init__(config, name=name, hidden_dim=hidden_dim, distributed=distributed, lr_scale=lr_scale)
        self._activation = ACTIVATIONS[config.activation]
        self._tensor_size = distributed.tensor_size
        initialization = NormalInitializationConfig(std=hidden_dim.global_size**-0.5)
        size = config.intermediate_size
        self.intermediate_dim = TensorDim("intermediate", size, parallel=True)
        if config.gated:
            output_dim = ConcatenatedTensorDim(
                "gate_up", [TensorDim("gate", size, parallel=True), TensorDim("up", size, parallel=True)]
            )
            input_configs = [config.gate, config.up]
        else:
            output_dim, input_configs = TensorDim("up", size, parallel=True), [config.up]
        input_projection = Linear(
            # Parameters named `gate_up.*` when gated, `up.*` otherwise: the names say what the weight holds.
            f"{name}.{'gate_up' if config.gated else 'up'}",
            input_configs,
            hidden_dim,
            output_dim,
            distributed,
            default_initialization=initialization,
            default_bias=config.add_linear_biases,
            lr_scale=lr_scale,
        )
        if config.gated:
            self.gate_up = input_projection
        else:
            self.up = input_projection
        self.down = Linear(
            f"{name}.down",
            config.down,
            self.intermediate_dim,
            hidden_dim,
            distributed,
            default_initialization=initialization,
            default_bias=config.add_linear_biases,
            lr_scale=lr_scale,
        )

    @property
    def input_projection(self) -> Linear:
        """gate‖up when gated, else up."""
        return self.gate_up if self.config.gated else self.up

    def forward(self, hidden: torch.Tensor, batch: Batch, state: Any = None) -> torch.Tensor:
        if self.config.gated:
            # Two products rather than one split afterwards: a faster backward pass once compiled (see forward_split).
            gate, up = self.gate_up.forward_split(hidden, self.intermediate_dim.local_size(self._tensor_size))
            if self.config.gate_multiplier != 1:
                gate = gate * self.config.gate_multiplier
            intermediate = self._activation(gate) * up
        else:
            intermediate = self._activation(self.up(hidden))
        output = self.down(intermediate)
        return output if self.config.down_multiplier == 1 else output * self.config.down_multiplier

    def flops(self, batch: Batch) -> tuple[int, int]:
        """Matrix products only: the activation and gating are a few operations per element, negligible beside them."""
        tokens = batch.num_tokens
        linears = (self.input_projection, self.down)
        return (
            sum(linear.forward_flops(tokens) for linear in linears),
            sum(linear.backward_flops(tokens) for linear in linears),
        )
