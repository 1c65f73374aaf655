"""Normalizations over the hidden dim of packed `[tokens, hidden]` states: `rms_norm`, `layer_norm`, `none`.

Their parameters are replicated between tensor-parallel ranks and act on token shards under
sequence-tensor-parallel (so their gradients are summed over the tensor group there).
"""

from __future__ import annotations

import torch
from torch import nn

from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.config import (
    ONES,
    ZEROS,
    LayerNormalizationConfig,
    NoNormalizationConfig,
    RMSNormalizationConfig,
    scaled_lr,
)
from blockzoo.layers.dims import TensorDim
from blockzoo.layers.parameter import create_parameter


class Identity(nn.Identity):
    def __init__(self, config: NoNormalizationConfig, **_: object):
        super().__init__()


class RMSNorm(nn.Module):
    def __init__(
        self,
        config: RMSNormalizationConfig,
        *,
        name: str,
        hidden_dim: TensorDim,
        distributed: Distributed,
        lr_scale: float,
    ):
        super().__init__()
        self.epsilon = config.epsilon
        lr_scale = scaled_lr(lr_scale, config.lr_scale)
        self.weight = self._parameter(f"{name}.weight", config.weight, ONES, hidden_dim, distributed, lr_scale)

    @staticmethod
    def _parameter(name, config, initialization, hidden_dim, distributed, lr_scale) -> nn.Parameter:
        settings = config.resolve(initialization=initialization, lr_scale=lr_scale, weight_decay=False)
        return create_parameter(name, (hidden_dim,), settings, distributed, token_sharded_input=True)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel: one pass forward and backward, the statistics in fp32 whatever the compute dtype;
        # written out, eager runs one kernel per operation.
        return torch.nn.functional.rms_norm(hidden, hidden.shape[-1:], self.weight.to(hidden.dtype), self.epsilon)


class LayerNorm(RMSNorm):
    def __init__(
        self,
        config: LayerNormalizationConfig,
        *,
        name: str,
        hidden_dim: TensorDim,
        distributed: Distributed,
        lr_scale: float,
    ):
        super().__init__(config, name=name, hidden_dim=hidden_dim, distributed=distributed, lr_scale=lr_scale)
        lr_scale = scaled_lr(lr_scale, config.lr_scale)
        self.bias = self._parameter(f"{name}.bias", config.bias, ZEROS, hidden_dim, distributed, lr_scale)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        output = torch.nn.functional.layer_norm(
            hidden.float(), hidden.shape[-1:], self.weight.float(), self.bias.float(), self.epsilon
        )
        return output.to(hidden.dtype)
