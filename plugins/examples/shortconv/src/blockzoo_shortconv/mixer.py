"""The `shortconv.gated_conv` mixer: y = out_proj(conv(x) · silu(gate)), [x, gate] = in_proj(hidden).

The layer contract (blockzoo.api.Mixer): built as `GatedConvolution(config, *, name, hidden_dim, distributed,
lr_scale)`, called as `forward(hidden [tokens, hidden], batch, state=None)` on packed documents. The convolution is
blockzoo's shared `blockzoo_ssm.causal_conv1d` (Mamba's conv1d), which restarts at every document.

Tensor parallel: the channels are split between ranks. `in_proj` is one column-parallel Linear over the concatenated
[x, gate] dim (each part split on its own, so a checkpoint holds [x of all channels; gate of all channels] whatever
the layout, and each part keeps its own config); the convolution's weight and bias are split with the channels;
`out_proj` is row-parallel. Sequence-tensor-parallel goes through the two Linears (they gather the token shards and
scatter the output back), so the convolution sees every token.

Generation: the state holds each sequence's last kernel_size - 1 inputs x of the convolution.

Slices of sequences (`forward_slice`: sequence-data parallelism, micro-sequences): the convolution of a slice needs
the kernel_size - 1 inputs x before it. `blockzoo_ssm.causal_conv1d_slice` takes them from the previous slice's
carry (one slice after another) or, over a sequence-data group, all-gathers every rank's last inputs and takes the
ones just before its slice (the halo; its backward sends the gradients back to the ranks they came from); the carry
is the last kernel_size - 1 inputs before the next slice, the same on every rank of the group. Nothing else of the
layer crosses a token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from blockzoo.api import (
    ZEROS,
    Batch,
    ConcatenatedTensorDim,
    Distributed,
    Linear,
    Mixer,
    NormalInitializationConfig,
    TensorDim,
    UniformInitializationConfig,
    create_parameter,
)
from blockzoo_ssm import causal_conv1d, causal_conv1d_slice

from blockzoo_shortconv.config import GatedConvolutionConfig


class GatedConvolution(Mixer):
    def __init__(
        self,
        config: GatedConvolutionConfig,
        *,
        name: str,
        hidden_dim: TensorDim,
        distributed: Distributed,
        lr_scale: float,
    ):
        lr_scale *= 1.0 if config.lr_scale is None else config.lr_scale
        super().__init__(config, name=name, hidden_dim=hidden_dim, distributed=distributed, lr_scale=lr_scale)
        channels = TensorDim("channels", config.channels, parallel=True)
        input_gate = ConcatenatedTensorDim(
            "input_gate",
            (TensorDim("input", config.channels, parallel=True), TensorDim("gate", config.channels, parallel=True)),
        )
        self._input_rows, self._gate_rows = input_gate.component_slices(distributed.tensor_size)
        linear = {
            "distributed": distributed,
            "default_initialization": NormalInitializationConfig(std=hidden_dim.global_size**-0.5),
            "default_bias": config.add_linear_biases,
            "lr_scale": lr_scale,
        }
        self.in_proj = Linear(f"{name}.in_proj", (config.input, config.gate), hidden_dim, input_gate, **linear)
        self.out_proj = Linear(f"{name}.out_proj", config.output, channels, hidden_dim, **linear)

        bound = config.kernel_size**-0.5
        weight = config.convolution.resolve(
            initialization=UniformInitializationConfig(low=-bound, high=bound), lr_scale=lr_scale
        )
        kernel = TensorDim("kernel", config.kernel_size)
        self.convolution_weight = create_parameter(
            f"{name}.convolution_weight", (channels, kernel), weight, distributed
        )
        self.convolution_bias = None
        if config.convolution_bias.enabled is not False:
            bias = config.convolution_bias.resolve(initialization=ZEROS, lr_scale=lr_scale, weight_decay=False)
            self.convolution_bias = create_parameter(f"{name}.convolution_bias", (channels,), bias, distributed)

    def forward(self, hidden: torch.Tensor, batch: Batch, state: torch.Tensor | None = None) -> torch.Tensor:
        projected = self.in_proj(hidden)
        x, gate = projected[:, self._input_rows], projected[:, self._gate_rows]
        convolved = causal_conv1d(x, self.convolution_weight, self.convolution_bias, batch, state=state)
        return self.out_proj(convolved * F.silu(gate))

    def forward_slice(
        self, hidden: torch.Tensor, batch: Batch, previous: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The mixer over one slice of longer sequences: (output, carry), the carry being the convolution's last
        kernel_size - 1 inputs [kernel_size - 1, channels] before the next slice (blockzoo.api.Mixer.forward_slice)."""
        projected = self.in_proj(hidden)
        x, gate = projected[:, self._input_rows], projected[:, self._gate_rows]
        convolved, carry = causal_conv1d_slice(x, self.convolution_weight, self.convolution_bias, batch, previous)
        return self.out_proj(convolved * F.silu(gate)), carry

    def new_state(self, num_sequences: int, max_length: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Each sequence's last kernel_size - 1 convolution inputs (this rank's channels)."""
        channels, kernel_size = self.convolution_weight.shape
        return torch.zeros(num_sequences, channels, kernel_size - 1, device=device, dtype=dtype)

    def flops(self, batch: Batch) -> tuple[int, int]:
        """The projections, plus a multiply-add per tap, channel and token for the convolution (twice that backward:
        input and weight gradients); the gating is a few operations per element, negligible beside them."""
        tokens = batch.num_tokens
        linears = (self.in_proj, self.out_proj)
        convolution = 2 * tokens * self.config.channels * self.config.kernel_size
        return (
            sum(linear.forward_flops(tokens) for linear in linears) + convolution,
            sum(linear.backward_flops(tokens) for linear in linears) + 2 * convolution,
        )
