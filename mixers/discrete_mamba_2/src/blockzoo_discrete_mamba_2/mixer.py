"""The discrete Mamba 2 mixer: fused in_proj, causal convolution over x‖B‖C, the SSD scan with A = -1 and an
unscaled input, the D skip, the z gate and out_proj. The numerics are `blockzoo_ssm`'s.

Tensor-parallel layout: the B/C groups are split between ranks, and with them their heads (head h uses group
h // (heads / groups), so a rank's heads are those of its groups). in_proj is column-parallel, each of its five
components split on its own, so a rank's rows are [x_r, B_r, C_r, z_r, dt_r] and its convolution channels
[x_r, B_r, C_r]; z_bias and d (the skip D) are split by head; out_proj is row-parallel. Under
sequence-tensor-parallel the two projections gather the token shards and scatter the output, so the convolution and
the scan see every token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blockzoo.api import (
    ONES,
    ZEROS,
    Batch,
    ConcatenatedTensorDim,
    Distributed,
    Linear,
    Mixer,
    TensorDim,
    UniformInitializationConfig,
    create_parameter,
    linear_options,
    scaled_lr,
)
from blockzoo_discrete_mamba_2.config import DiscreteMamba2Config
from blockzoo_ssm import CausalConvolution, GroupMajorDims, SSMCarry, SSMState, ssd_scan, ssd_scan_slice


class DiscreteMamba2State(SSMState):
    """`SSMState` with the SSM state [sequences, heads, head_size, state_size], of this rank's heads."""

    @property
    def conv(self) -> torch.Tensor:
        """The convolution's state under the name this state has always given it."""
        return self.convolution


class DiscreteMamba2(Mixer):
    def __init__(
        self,
        config: DiscreteMamba2Config,
        *,
        name: str,
        hidden_dim: TensorDim,
        distributed: Distributed,
        lr_scale: float,
    ):
        lr_scale = scaled_lr(lr_scale, config.lr_scale)
        super().__init__(config, name=name, hidden_dim=hidden_dim, distributed=distributed, lr_scale=lr_scale)
        groups, tensor_size = config.resolved_groups, distributed.tensor_size
        if groups % tensor_size:
            raise ValueError(f"discrete_mamba_2 {name!r}: tensor_parallel={tensor_size} must divide groups ({groups})")
        dims = GroupMajorDims(
            heads=config.heads, groups=groups, head_size=config.head_size, state_size=config.state_size
        )
        inner, heads_dim = dims.inner, dims.heads()
        # The reference's row order; x‖B‖C lead, so the convolution's input is one slice of in_proj's output.
        in_proj_dim = ConcatenatedTensorDim(
            "in_proj", (inner("x"), dims.group_state("b"), dims.group_state("c"), inner("z"), heads_dim)
        )
        convolution_dim = ConcatenatedTensorDim("convolution", in_proj_dim.dims[:3])
        self._in_proj_slices = in_proj_dim.component_slices(tensor_size)
        self._local_heads = heads_dim.local_size(tensor_size)
        self._local_groups = dims.group.local_size(tensor_size)

        linear = linear_options(config, distributed, lr_scale, std=hidden_dim.global_size**-0.5)
        in_proj_configs = [getattr(config, component) for component in config.IN_PROJ_COMPONENTS]
        self.in_proj = Linear(f"{name}.in_proj", in_proj_configs, hidden_dim, in_proj_dim, **linear)
        # The reference's conv bias keeps torch's Conv1d initialization, like its weight.
        bound = config.convolution.kernel_size**-0.5
        self.convolution = CausalConvolution(
            config.convolution,
            name=f"{name}.convolution",
            channels_dim=convolution_dim,
            distributed=distributed,
            lr_scale=lr_scale,
            bias_initialization=UniformInitializationConfig(low=-bound, high=bound),
        )
        # The reference adds z_bias only when in_proj has no bias (which then plays its part).
        self.z_bias = (
            None
            if config.in_proj_has_bias
            else create_parameter(
                f"{name}.z_bias",
                (inner("z_bias"),),
                config.z_bias.resolve(initialization=ZEROS, lr_scale=lr_scale, weight_decay=False),
                distributed,
            )
        )
        self.d = create_parameter(
            f"{name}.d",
            (heads_dim,),
            config.d.resolve(initialization=ONES, lr_scale=lr_scale, weight_decay=False),
            distributed,
        )
        self.out_proj = Linear(f"{name}.out_proj", config.out_proj, inner("inner"), hidden_dim, **linear)

    def forward(self, hidden: torch.Tensor, batch: Batch, state: DiscreteMamba2State | None = None) -> torch.Tensor:
        if state is not None:
            state.check(batch, f"discrete_mamba_2 {self.name!r}")
        projected = self.in_proj(hidden)  # Every token of the batch, this rank's rows.
        xbc = self.convolution(
            self._xbc(projected), batch, activation=self._activation, state=None if state is None else state.convolution
        )
        y = ssd_scan(
            *self._scan_inputs(projected, xbc),
            batch,
            chunk_size=self.config.chunk_size,
            D=self.d,
            scale_input=False,
            state=None if state is None else state.ssm,
        )
        return self._output(projected, y)

    def forward_slice(
        self, hidden: torch.Tensor, batch: Batch, previous: SSMCarry | None
    ) -> tuple[torch.Tensor, SSMCarry]:
        """`Mixer.forward_slice` with an unscaled input: the convolution and the scan continue `previous`
        (`blockzoo_ssm.slices`)."""
        previous_inputs, previous_state = (None, None) if previous is None else previous
        projected = self.in_proj(hidden)
        xbc, convolution = self.convolution.forward_slice(
            self._xbc(projected), batch, previous_inputs, activation=self._activation
        )
        y, ssm = ssd_scan_slice(
            *self._scan_inputs(projected, xbc),
            batch,
            previous_state,
            chunk_size=self.config.chunk_size,
            D=self.d,
            scale_input=False,
        )
        return self._output(projected, y), SSMCarry(convolution, ssm)

    @property
    def _activation(self) -> str | None:
        return None if self.config.activation == "identity" else self.config.activation

    def _xbc(self, projected: torch.Tensor) -> torch.Tensor:
        """The convolution's input x‖B‖C: the leading rows of in_proj's output."""
        return projected[:, : self._in_proj_slices[2].stop]

    def _scan_inputs(self, projected: torch.Tensor, xbc: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(x, dt, A, B, C) of the scan: dt = softplus(in_proj's dt) in fp32, A = -1 for every head."""
        config = self.config
        x_slice, b_slice, c_slice, _, dt_slice = self._in_proj_slices
        return (
            xbc[:, x_slice].unflatten(1, (self._local_heads, config.head_size)),
            F.softplus(projected[:, dt_slice].float()),
            -torch.ones(self._local_heads, device=projected.device),
            xbc[:, b_slice].unflatten(1, (self._local_groups, config.state_size)),
            xbc[:, c_slice].unflatten(1, (self._local_groups, config.state_size)),
        )

    def _output(self, projected: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """out_proj(y · silu(z + z_bias))."""
        z = projected[:, self._in_proj_slices[3]]
        if self.z_bias is not None:
            z = z + self.z_bias.to(z.dtype)
        return self.out_proj(y.reshape(len(y), -1) * F.silu(z))

    def new_state(
        self, num_sequences: int, max_length: int, device: torch.device, dtype: torch.dtype
    ) -> DiscreteMamba2State:
        shape = (num_sequences, self._local_heads, self.config.head_size, self.config.state_size)
        return DiscreteMamba2State(
            self.convolution.new_state(num_sequences, device, dtype),
            torch.zeros(shape, device=device, dtype=torch.float32),
        )

    def flops(self, batch: Batch) -> tuple[int, int]:
        tokens = batch.num_tokens
        forward = sum(linear.forward_flops(tokens) for linear in (self.in_proj, self.out_proj))
        backward = sum(linear.backward_flops(tokens) for linear in (self.in_proj, self.out_proj))
        convolution_forward, convolution_backward = self.convolution.flops(tokens)
        # The recurrence per token and head: decay and add x ⊗ B into the state (2·head_size·state_size), read it
        # out with C (2·head_size·state_size). The chunked kernels do more; this counts the model's work.
        # Elementwise work (softplus, D skip, gate) is not counted. The backward costs twice the forward.
        scan = 4 * tokens * self.config.heads * self.config.head_size * self.config.state_size
        return forward + convolution_forward + scan, backward + convolution_backward + 2 * scan
