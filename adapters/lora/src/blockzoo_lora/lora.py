"""LoRA adapters of a `Linear`, tensor-parallel like the linear they adapt.

Each enabled component of the linear (the whole linear, or one part of a concatenated one: the value of key‖value,
z of Mamba's in_proj) gets its own A `[rank, in]` and B `[out_component, rank]`; the adapter returns the update of
this rank's whole local output, zeros where a component has none. The linear adds it where its own output is still
local: after the input entered the tensor region (column-parallel: A replicated, B split on its output rows like the
weight) or before the reduction (row-parallel: A split on its input columns like the weight, B replicated; the
reduction then sums the partial updates as it sums the partial outputs).

Gradients: a replicated A or B whose gradient on each rank is a partial sum (A of a column-parallel linear, B of a
row-parallel one, both inside the tensor region) is flagged for a sum over the tensor group; a plain linear's A and B
see token shards under sequence-tensor parallelism and are flagged so too (`create_parameter`).

A is initialized uniform in ±1/sqrt(in) (torch's and peft's default for a linear), B to zeros, so a fresh adapter
changes nothing. Both take the learning-rate scale and weight decay of the component's weight.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from blockzoo.layers.config import ZEROS, ResolvedParameter, UniformInitializationConfig
from blockzoo.layers.dims import TensorDim
from blockzoo.layers.parameter import create_parameter
from blockzoo_lora.config import LoraConfig

if TYPE_CHECKING:
    from blockzoo.distributed.runtime import Distributed
    from blockzoo.layers.linear import Linear


def component_keys(linear: Linear) -> tuple[str, ...]:
    """How the adapter of `linear` names its components: the names of a concatenated output's parts (`key`, `value`;
    `gate`, `up`; Mamba's `z`, `x`, ...), `0` for a linear of one component (the index where names would clash)."""
    dims, _ = linear.output_components(1)
    names = tuple(dim.name for dim in dims)
    if len(dims) == 1 or len(set(names)) < len(names) or not all(name.isidentifier() for name in names):
        return tuple(str(index) for index in range(len(dims)))
    return names


class LoraAdapter(nn.Module):
    """The LoRA update of one linear. Parameters `lora_a.<component>` and `lora_b.<component>`, `<component>` the name
    of the component of the linear's concatenated output (`component_keys`: `value` of key‖value), `0` for a linear
    of one component. `keys[i]` names component i."""

    def __init__(self, config: LoraConfig, linear: Linear, distributed: Distributed):
        super().__init__()
        self.config = config
        self.scale = config.scale
        self.merged = False
        self.dropout = nn.Dropout(config.dropout) if config.dropout else nn.Identity()
        components, local_slices = linear.output_components(distributed.tensor_size)
        self.local_slices = local_slices
        self.keys = component_keys(linear)
        rank_dim = TensorDim("lora_rank", config.rank)
        bound = linear.input_dim.global_size**-0.5
        a_options = _gradient_options(linear, a=True)
        b_options = _gradient_options(linear, a=False)
        self.lora_a = nn.ParameterDict()
        self.lora_b = nn.ParameterDict()
        for index, (dim, enabled, weight) in enumerate(zip(components, linear.peft_components, linear.weight_settings)):
            if not enabled:
                continue
            settings = {"lr_scale": weight.lr_scale, "weight_decay": weight.weight_decay}
            key = self.keys[index]
            self.lora_a[key] = create_parameter(
                f"{linear.name}.adapter.lora_a.{key}",
                (rank_dim, linear.input_dim),
                ResolvedParameter(initialization=UniformInitializationConfig(low=-bound, high=bound), **settings),
                distributed,
                **a_options,
            )
            self.lora_b[key] = create_parameter(
                f"{linear.name}.adapter.lora_b.{key}",
                (dim, rank_dim),
                ResolvedParameter(initialization=ZEROS, **settings),
                distributed,
                **b_options,
            )

    def former_parameter_names(self) -> dict[str, str]:
        """{name before, name now} (under the adapter) of the parameters whose name changed: checkpoints written before
        adapters took their components' names hold `lora_a.<index>`; the loader reads those as the new names
        (`blockzoo.peft.apply.former_adapter_names`)."""
        renamed = {}
        for index, key in enumerate(self.keys):
            if key != str(index) and key in self.lora_a:
                for part in ("lora_a", "lora_b"):
                    renamed[f"{part}.{index}"] = f"{part}.{key}"
        return renamed

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """The update of this rank's local output for `input` (the linear's input once local to this rank)."""
        input = self.dropout(input)
        parts = []
        for key, rows in zip(self.keys, self.local_slices):
            if key in self.lora_a:
                a, b = self.lora_a[key].to(input.dtype), self.lora_b[key].to(input.dtype)
                parts.append(F.linear(F.linear(input, a), b) * self.scale)
            else:
                parts.append(input.new_zeros(*input.shape[:-1], rows.stop - rows.start))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def delta_weight(self, index: int) -> torch.Tensor:
        """scale · B A of component `index`: its update of this rank's rows (or columns) of the weight."""
        key = self.keys[index]
        return self.scale * (self.lora_b[key] @ self.lora_a[key])

    @torch.no_grad()
    def merge_into(self, weight: torch.Tensor, sign: float = 1.0) -> None:
        """Add (sign 1) or take back (sign -1) the update to this rank's shard of the linear's weight."""
        for index, rows in enumerate(self.local_slices):
            if self.keys[index] in self.lora_a:
                weight[rows] += sign * self.delta_weight(index).to(weight.dtype)


def _gradient_options(linear: Linear, *, a: bool) -> dict[str, bool]:
    if linear.column_parallel:
        return {"partial_gradient": a}  # B is split like the weight's rows; A's gradient sums over B's shards
    if linear.row_parallel:
        return {"partial_gradient": not a}  # A is split like the weight's columns; B sees partial sums
    if linear.inside_tensor_region:
        return {"partial_gradient": True}
    return {"token_sharded_input": True}
