"""The `decoder` block: norm → mixer → residual → norm → MLP → residual, either part optional.

Over a slice of sequences (`forward_slice`) the mixer runs its `forward_slice`, taking the carry of the slice before
and returning its own; the MLP acts on each token, as always.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from blockzoo.config import ConfigFieldError
from blockzoo.distributed.runtime import Distributed
from blockzoo.layer_errors import LayerOutputError
from blockzoo.layers.base import Batch
from blockzoo.layers.config import TENSOR_PARALLEL, scaled_lr
from blockzoo.layers.dims import TensorDim
from blockzoo.model.config import DecoderBlockConfig
from blockzoo.plugins import get_registry


def build_part(config: Any, *, name: str, **kwargs: Any) -> nn.Module | None:
    """Build a mixer, MLP or normalization from its config through its registered implementation (None for `none`)."""
    implementation = get_registry().implementation_of(config)
    if implementation is None:
        return None
    check_layout(config, name, kwargs["distributed"])
    return implementation(config, name=name, **kwargs)


def check_layout(config: Any, name: str, distributed: Distributed) -> None:
    """Refuse, before a mixer or MLP is built, a tensor-parallel split its config cannot do: one it does not declare
    (`capabilities`), or one its `check_tensor_parallel(n)` refuses. Here once for every plugin, so a layer never
    has to call it (a run's config checks the same before anything is built)."""
    size, capabilities = distributed.tensor_size, getattr(type(config), "capabilities", None)
    if size == 1 or capabilities is None:
        return
    type_name = get_registry(strict=False).type_name_or(type(config), type(config).__name__)
    what = f"{config.kind} {name!r} (type {type_name!r})"
    if TENSOR_PARALLEL not in capabilities:
        raise ValueError(f"{what} does not support tensor-parallel (tensor_parallel={size})")
    try:
        config.check_tensor_parallel(size)
    except ConfigFieldError as error:
        raise ValueError(f"{what}: {error.field_name}: {error.message}") from None


def not_a_view(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, copied if it is a view (FSDP hooks every tensor a block returns, and warns of views)."""
    return tensor if tensor._base is None else tensor.clone()


def scaled(tensor: torch.Tensor, multiplier: float) -> torch.Tensor:
    """`tensor * multiplier`, or `tensor` itself for 1 (the default: no extra operation, bit-identical)."""
    return tensor if multiplier == 1 else tensor * multiplier


class DecoderBlock(nn.Module):
    def __init__(
        self, config: DecoderBlockConfig, *, name: str, hidden_dim: TensorDim, distributed: Distributed, lr_scale: float
    ):
        super().__init__()
        lr_scale = scaled_lr(lr_scale, config.lr_scale)
        common = {"hidden_dim": hidden_dim, "distributed": distributed, "lr_scale": lr_scale}
        self.residual_multiplier = config.residual_multiplier
        self.mixer = build_part(config.mixer, name=f"{name}.mixer", **common)
        self.mlp = build_part(config.mlp, name=f"{name}.mlp", **common)
        # Module names follow the parts they normalize, so a block without an MLP has no `norm_2`.
        if self.mixer is not None:
            self.norm_1 = build_part(config.normalization, name=f"{name}.norm_1", **common)
            if config.post_mixer_normalization is not None:
                self.post_mixer_norm = build_part(
                    config.post_mixer_normalization, name=f"{name}.post_mixer_norm", **common
                )
        if self.mlp is not None:
            self.norm_2 = build_part(config.normalization, name=f"{name}.norm_2", **common)
            if config.post_mlp_normalization is not None:
                self.post_mlp_norm = build_part(config.post_mlp_normalization, name=f"{name}.post_mlp_norm", **common)

    def forward(self, hidden: torch.Tensor, batch: Batch, state: Any = None) -> torch.Tensor:
        if self.mixer is not None:
            hidden = self._add_mixer_output(hidden, self.mixer(self.norm_1(hidden), batch, state))
        return self._mlp_part(hidden, batch)

    def forward_slice(self, hidden: torch.Tensor, batch: Batch, previous: Any) -> tuple[torch.Tensor, Any]:
        """The block over one slice of longer sequences: (output, the mixer's carry); see `Mixer.forward_slice`."""
        carry = None
        if self.mixer is not None:
            output, carry = self.mixer.forward_slice(self.norm_1(hidden), batch, previous)
            hidden = self._add_mixer_output(hidden, output)
            # FSDP hooks every tensor a block returns, and warns of views (an in-place change of one would skip its
            # hook): the carry's views (small: a window's rows, a convolution's last inputs) are copied.
            carry = tree_map_only(torch.Tensor, not_a_view, carry)
        return self._mlp_part(hidden, batch), carry

    def _add_mixer_output(self, hidden: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        if output.shape != hidden.shape:  # a plugin's bug, named by the CLI (the residual sum might broadcast it)
            raise LayerOutputError(self.mixer, output.shape, hidden.shape)
        if hasattr(self, "post_mixer_norm"):
            output = self.post_mixer_norm(output)
        return hidden + scaled(output, self.residual_multiplier)

    def _mlp_part(self, hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
        if self.mlp is not None:
            output = self.mlp(self.norm_2(hidden), batch)
            if output.shape != hidden.shape:
                raise LayerOutputError(self.mlp, output.shape, hidden.shape)
            if hasattr(self, "post_mlp_norm"):
                output = self.post_mlp_norm(output)
            hidden = hidden + scaled(output, self.residual_multiplier)
        return hidden

    def flops(self, batch: Batch) -> tuple[int, int]:
        parts = [part.flops(batch) for part in (self.mixer, self.mlp) if part is not None]
        return sum(f for f, _ in parts), sum(b for _, b in parts)

    def new_state(self, num_sequences: int, max_length: int, device: torch.device, dtype: torch.dtype) -> Any:
        return None if self.mixer is None else self.mixer.new_state(num_sequences, max_length, device, dtype)
