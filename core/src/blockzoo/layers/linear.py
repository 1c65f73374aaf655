"""The linear layer every mixer and MLP uses; tensor-parallel by its dims.

- Output dim split ⇒ column-parallel: every rank sees all tokens and computes its slice of the
  features. Its input enters the tensor-parallel region: identity forward / all-reduce backward, or
  with sequence-tensor-parallel, an all-gather of the token-split input / reduce-scatter backward.
- Input dim split ⇒ row-parallel: every rank computes a partial sum of the output, reduced with an
  all-reduce, or with sequence-tensor-parallel a reduce-scatter along tokens (all-gather backward).
  The bias is replicated and added after the reduction.
- Neither ⇒ plain. Under sequence-tensor-parallel its input is taken to be token-split (the residual
  stream), so its replicated parameters are flagged for a gradient sum over the tensor group, as is
  the bias of a row-parallel linear.
- Neither, but `inside_tensor_region` ⇒ replicated inside the tensor-parallel region (MQA's key/value
  when the query heads are split): its input enters the region as a column-parallel linear's does, and
  since each rank's output only feeds that rank's share of the work, its gradients are partial sums,
  flagged for a sum over the tensor group.

Activations are packed `[tokens, features]`.

PEFT (`blockzoo.peft`): each component resolves its `apply_peft` from its config or the parent's `default_peft`; an
adapter, once attached (`adapter`), adds its update where the output is still this rank's own: after the input
entered the tensor region, or before the row-parallel reduction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from blockzoo.distributed.ops import (
    copy_to_tensor_region,
    gather_tokens,
    reduce_from_tensor_region,
    reduce_scatter_tokens,
)
from blockzoo.layers.config import InitializationConfig, LinearConfig, NormalInitializationConfig
from blockzoo.layers.dims import TensorDim
from blockzoo.layers.parameter import create_parameter

if TYPE_CHECKING:
    from blockzoo.distributed.runtime import Distributed


class Linear(nn.Module):
    """`y = x Wᵀ + b` over packed `[tokens, features]`, tensor-parallel as its dims say (module docstring):
    `input_dim` and `output_dim` are `TensorDim`s (a `ConcatenatedTensorDim` output with one `LinearConfig` per
    component, e.g. key‖value), the weight and bias made by `create_parameter` under `name`. The defaults
    (`default_initialization`, `default_bias`, `lr_scale`, `default_peft`) are the parent layer's; each config's
    fields override them. `forward_flops(tokens)` / `backward_flops(tokens)` count its products for `flops`."""

    def __init__(
        self,
        name: str,
        config: LinearConfig | Sequence[LinearConfig],
        input_dim: TensorDim,
        output_dim: TensorDim,
        distributed: Distributed,
        *,
        default_initialization: InitializationConfig,
        default_bias: bool = False,
        lr_scale: float = 1.0,
        default_peft: bool | Sequence[bool] = False,
        inside_tensor_region: bool = False,
        device: torch.device | str | None = None,
    ):
        """`name`: the full name of the layer (its parameters are `name.weight`, `name.bias`).

        `config`: one `LinearConfig`, or one per component of a concatenated `output_dim`, each honoured
        for its rows of the weight and bias. `default_bias` is the parent's `add_linear_biases`,
        `lr_scale` the parent's learning-rate scale, `default_peft` the parent's default `apply_peft` (one, or one per
        component). `inside_tensor_region`: a replicated linear whose output
        feeds this rank's share of tensor-parallel work (see the module doc). `device="meta"` skips initialization.
        """
        super().__init__()
        if input_dim.parallel and output_dim.parallel:
            raise ValueError(
                f"linear {name!r}: input dim {input_dim.name!r} and output dim {output_dim.name!r} are both split"
            )
        configs = (config,) if isinstance(config, LinearConfig) else tuple(config)
        self.name = name
        self.input_dim = input_dim
        self.output_dim = output_dim
        if inside_tensor_region and (input_dim.parallel or output_dim.parallel):
            raise ValueError(f"linear {name!r}: only a replicated linear can be marked inside the tensor region")
        self.column_parallel = output_dim.parallel
        self.row_parallel = input_dim.parallel
        self.inside_tensor_region = inside_tensor_region
        self._tensor_group = distributed.tensor_group
        self._sequence_tensor_parallel = distributed.sequence_tensor_parallel
        defaults = (default_peft,) * len(configs) if isinstance(default_peft, bool) else tuple(default_peft)
        if len(defaults) != len(configs):
            raise ValueError(f"linear {name!r}: {len(defaults)} default_peft values for {len(configs)} components")
        self.peft_components = tuple(c.use_peft(default) for c, default in zip(configs, defaults))
        # Set by `blockzoo.peft.apply_peft`: a module whose output is added to this rank's local output.
        self.adapter: nn.Module | None = None
        # `training.fp8`: whether the configs allow FP8 (`fp8`), and, set by `blockzoo.distributed.fp8`, `F.linear`'s
        # replacement computing the products in FP8.
        self.fp8 = all(c.fp8 for c in configs)
        self.float8: Callable | None = None

        weight_settings = [c.resolve_weight(initialization=default_initialization, lr_scale=lr_scale) for c in configs]
        self.weight = create_parameter(
            f"{name}.weight",
            (output_dim, input_dim),
            weight_settings,
            distributed,
            token_sharded_input=not (self.column_parallel or self.row_parallel or inside_tensor_region),
            partial_gradient=inside_tensor_region,
            device=device,
        )
        self.weight_settings = tuple(weight_settings)
        bias_settings = [c.resolve_bias(enabled=default_bias, lr_scale=lr_scale) for c in configs]
        if len({settings is None for settings in bias_settings}) > 1:
            raise ValueError(f"linear {name!r}: the components must all have a bias or none, got {bias_settings}")
        self.bias = (
            None
            if bias_settings[0] is None
            else create_parameter(
                f"{name}.bias",
                (output_dim,),
                bias_settings,
                distributed,
                token_sharded_input=not (self.column_parallel or inside_tensor_region),
                partial_gradient=inside_tensor_region,
                device=device,
            )
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        product, weight = self._product(input)
        bias = None if self.bias is None else self.bias.to(input.dtype)
        adapter = self._active_adapter
        if self.row_parallel:
            reduce = reduce_scatter_tokens if self._sequence_tensor_parallel else reduce_from_tensor_region
            partial = product(input, weight)
            if adapter is not None:  # a partial sum too: the reduction adds the ranks' updates
                partial = partial + adapter(input)
            output = reduce(partial, self._tensor_group)
            return output if bias is None else output + bias
        input = self._enter(input)
        output = product(input, weight, bias)
        return output if adapter is None else output + adapter(input)

    def forward_split(self, input: torch.Tensor, size: int) -> tuple[torch.Tensor, ...]:
        """`forward(input).split(size, dim=-1)` (of this rank's output), each part its own product with its rows of
        the weight; not for a row-parallel linear.

        The values are the same (under FP8 each part is scaled on its own, as separate linears are: torchtitan's gate
        and up projections); the backward pass under torch.compile is cheaper. Of one product split afterwards, the
        gradient is the concatenation of the parts' gradients, which inductor writes with one masked kernel that
        reads the inputs the parts share once per part; of separate products, both parts' gradients come from one
        plain pass."""
        if self.row_parallel:
            raise NotImplementedError(f"linear {self.name!r}: forward_split of a row-parallel linear")
        product, weight = self._product(input)
        weights = weight.split(size)
        biases = [None] * len(weights) if self.bias is None else self.bias.to(input.dtype).split(size)
        input = self._enter(input)
        outputs = tuple(product(input, weight, bias) for weight, bias in zip(weights, biases))
        if (adapter := self._active_adapter) is None:
            return outputs
        return tuple(output + update for output, update in zip(outputs, adapter(input).split(size, dim=-1)))

    def _product(self, input: torch.Tensor) -> tuple[Callable, torch.Tensor]:
        """`F.linear` and the weight in the activations' dtype (master weights stay fp32), or under FP8 its product
        and the weight as it is (the FP8 product casts it itself, from its dtype)."""
        if self.float8 is None:
            return F.linear, self.weight.to(input.dtype)
        return self.float8, self.weight

    @property
    def _active_adapter(self) -> nn.Module | None:
        """The adapter whose update is still to be added (none once merged into the weight)."""
        return None if self.adapter is None or self.adapter.merged else self.adapter

    def _enter(self, input: torch.Tensor) -> torch.Tensor:
        """The input of a column-parallel linear, or one inside the tensor region, enters the region."""
        if not (self.column_parallel or self.inside_tensor_region):
            return input
        enter = gather_tokens if self._sequence_tensor_parallel else copy_to_tensor_region
        return enter(input, self._tensor_group)

    def output_components(self, tp_size: int) -> tuple[tuple[TensorDim, ...], list[slice]]:
        """(dims, rows of this rank's local output) of each component: those of a concatenated output dim when the
        linear has one config per component, else the whole output dim."""
        if len(self.peft_components) > 1:
            return self.output_dim.dims, self.output_dim.component_slices(tp_size)
        return (self.output_dim,), [slice(0, self.output_dim.local_size(tp_size))]

    def forward_flops(self, tokens: int) -> int:
        """Floating-point operations of the forward pass over `tokens` tokens, all ranks together."""
        return 2 * tokens * self.input_dim.global_size * self.output_dim.global_size

    def backward_flops(self, tokens: int) -> int:
        """The input gradient costs as much as the forward, and so does the weight gradient unless frozen."""
        return self.forward_flops(tokens) * (2 if self.weight.requires_grad else 1)

    def extra_repr(self) -> str:
        layout = (
            "column-parallel"
            if self.column_parallel
            else "row-parallel"
            if self.row_parallel
            else "replicated in the tensor region"
            if self.inside_tensor_region
            else "replicated"
        )
        return f"{self.name}: {self.input_dim} -> {self.output_dim}, {layout}, bias={self.bias is not None}"


def linear_options(config: Any, distributed: Distributed, lr_scale: float, *, std: float) -> dict[str, Any]:
    """The keyword arguments a layer's linears share: `distributed`, a normal initialization of standard deviation
    `std` (often the input width to the power -1/2), biases as the layer config's `add_linear_biases` says, and the
    layer's learning-rate scale: `Linear(name, config.query, input_dim, output_dim, **linear_options(...))`."""
    return {
        "distributed": distributed,
        "default_initialization": NormalInitializationConfig(std=std),
        "default_bias": config.add_linear_biases,
        "lr_scale": lr_scale,
    }
