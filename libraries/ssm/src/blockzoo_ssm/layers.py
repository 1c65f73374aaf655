"""The layer the Mamba mixers share: the causal depthwise convolution with its parameters."""

from __future__ import annotations

import torch
from torch import nn

from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.base import Batch
from blockzoo.layers.config import InitializationConfig, UniformInitializationConfig
from blockzoo.layers.dims import TensorDim
from blockzoo.layers.parameter import create_parameter
from blockzoo_ssm.config import ConvolutionConfig
from blockzoo_ssm.conv import causal_conv1d
from blockzoo_ssm.kernels import mamba_ssm_available
from blockzoo_ssm.slices import causal_conv1d_slice


class CausalConvolution(nn.Module):
    """`causal_conv1d` over `channels_dim` with parameters `weight` [channels, kernel_size] and `bias` [channels].

    `bias_initialization`: the mixer's default for the bias (zeros in HF's Mamba models, torch's Conv1d uniform in
    the discrete Mamba 2 reference); the weight defaults to torch's Conv1d uniform(±kernel_size^-0.5).
    """

    def __init__(
        self,
        config: ConvolutionConfig,
        *,
        name: str,
        channels_dim: TensorDim,
        distributed: Distributed,
        lr_scale: float,
        bias_initialization: InitializationConfig,
    ):
        super().__init__()
        self.kernel_size = config.kernel_size
        lr_scale *= 1.0 if config.lr_scale is None else config.lr_scale
        bound = config.kernel_size**-0.5  # torch's Conv1d default (kaiming uniform, a=√5) for a depthwise filter.
        weight = config.weight.resolve(
            initialization=UniformInitializationConfig(low=-bound, high=bound), lr_scale=lr_scale
        )
        if distributed.device.type == "cuda":
            # Import mamba_ssm (for the scans and norms of every SSM mixer) now, not on a first forward that may run
            # inside a compiled block: imported under torch.compile's tracing, transformers' scipy import failed
            # (on one H200, torch 2.11).
            mamba_ssm_available()
        kernel_dim = TensorDim("kernel", config.kernel_size)
        self.weight = create_parameter(f"{name}.weight", (channels_dim, kernel_dim), weight, distributed)
        self.bias = None
        if config.has_bias:
            bias = config.bias.resolve(initialization=bias_initialization, lr_scale=lr_scale, weight_decay=False)
            self.bias = create_parameter(f"{name}.bias", (channels_dim,), bias, distributed)

    def forward(
        self, x: torch.Tensor, batch: Batch, *, activation: str | None = None, state: torch.Tensor | None = None
    ) -> torch.Tensor:
        # causal_conv1d computes in fp32 whatever the activations' dtype: the fp32 master weights go in as they are.
        return causal_conv1d(x, self.weight, self.bias, batch, activation=activation, state=state)

    def forward_slice(
        self, x: torch.Tensor, batch: Batch, previous: torch.Tensor | None, *, activation: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Over a slice of longer sequences: (y, carry), `causal_conv1d_slice`; `previous`: the preceding slice's
        carry, its last kernel_size - 1 inputs (None at the start)."""
        return causal_conv1d_slice(x, self.weight, self.bias, batch, previous, activation=activation)

    def new_state(self, num_sequences: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Zero generation state: the last kernel_size - 1 inputs of each sequence [sequences, channels,
        kernel_size - 1], this rank's channels."""
        return torch.zeros(num_sequences, len(self.weight), self.kernel_size - 1, device=device, dtype=dtype)

    def flops(self, tokens: int) -> tuple[int, int]:
        """(forward, backward): one multiply-add per tap, channel and token; the backward computes the input's
        gradient and, unless frozen, the filters'."""
        forward = 2 * tokens * self.weight.meta.global_shape[0] * self.kernel_size
        return forward, forward * (2 if self.weight.requires_grad else 1)
