"""The Mamba 2 (SSD) mixer over packed documents.

in_proj → [z, x, B, C, dt]; causal depthwise convolution + silu over x‖B‖C; dt = clamp(softplus(dt + dt_bias));
y = SSD scan of x with A = -exp(A_log), B, C; y += D·x; y = RMSNorm(y · silu(z)) · weight; out_proj(y).
The output norm has two variants (`GatedNormalizationConfig`): RMSNorm(y) · weight · silu(z) (`norm_before_gate`) and
none, y · silu(z) (`enabled: false`, no weight).
The numerics (convolution, scan, gated norm) are `blockzoo_ssm`'s; this module holds the parameters and the layout.

Tensor-parallel layout: heads are laid out group-major (head h reads B/C group h // (heads / groups)), so splitting
the groups between ranks gives each rank whole groups and their heads. Each in_proj component (z, x, B, C, dt) is
split on its own (column-parallel), as are the convolution's channels (x, B, C), dt_bias, A_log, D and the norm's
weight; out_proj is row-parallel. Under sequence-tensor-parallel in_proj gathers the token shards and out_proj
scatters its output, so the convolution and the scan always see every token of the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockzoo.api import (
    ONES,
    ZEROS,
    Batch,
    ConcatenatedTensorDim,
    Distributed,
    InitializationConfig,
    Linear,
    Mixer,
    ParameterConfig,
    TensorDim,
    create_parameter,
    linear_options,
    scaled_lr,
)
from blockzoo_mamba_2.config import IN_PROJ_COMPONENTS, GatedNormalizationConfig, Mamba2Config
from blockzoo_ssm import (
    ALogRangeInitializationConfig,
    CausalConvolution,
    DtBiasInitializationConfig,
    GroupMajorDims,
    ScanLayout,
    SSMCarry,
    SSMState,
    convolved_ssd_scan,
    gated_rms_norm,
    ssd_scan,
    ssd_scan_slice,
)


class Mamba2State(SSMState):
    """`SSMState` with the SSM state `[sequences, heads, head_size, state_size]`."""


class GatedRMSNorm(nn.Module):
    """RMSNorm(y · silu(z)) · weight, or RMSNorm(y) · weight · silu(z) with `norm_before_gate`; statistics over
    groups of `group_size` channels."""

    def __init__(
        self,
        config: GatedNormalizationConfig,
        *,
        name: str,
        channels: TensorDim,
        group_size: int,
        distributed: Distributed,
        lr_scale: float,
    ):
        super().__init__()
        lr_scale = scaled_lr(lr_scale, config.lr_scale)
        self.epsilon = config.epsilon
        self.group_size = group_size
        self.norm_before_gate = config.norm_before_gate
        settings = config.weight.resolve(initialization=ONES, lr_scale=lr_scale, weight_decay=False)
        self.weight = create_parameter(f"{name}.weight", (channels,), settings, distributed)

    def forward(self, input: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(
            input,
            gate,
            self.weight,
            epsilon=self.epsilon,
            group_size=self.group_size,
            norm_before_gate=self.norm_before_gate,
        )


class Mamba2(Mixer):
    def __init__(
        self, config: Mamba2Config, *, name: str, hidden_dim: TensorDim, distributed: Distributed, lr_scale: float
    ):
        lr_scale = scaled_lr(lr_scale, config.lr_scale)
        super().__init__(config, name=name, hidden_dim=hidden_dim, distributed=distributed, lr_scale=lr_scale)
        # Group-major dims: splitting the groups splits the heads, their channels and their B/C alike.
        dims = GroupMajorDims(
            heads=config.heads, groups=config.groups, head_size=config.head_size, state_size=config.state_size
        )
        heads_dim = dims.heads()
        inner_dim = dims.inner("inner")
        in_proj_dims = {
            "z": dims.inner("z"),
            "x": dims.inner("x"),
            "b": dims.group_state("b"),
            "c": dims.group_state("c"),
            "dt": dims.heads("dt"),
        }
        in_proj_dim = ConcatenatedTensorDim("in_proj", [in_proj_dims[role] for role in IN_PROJ_COMPONENTS])
        convolution_dim = ConcatenatedTensorDim("convolution", [in_proj_dims[role] for role in ("x", "b", "c")])
        # This rank's in_proj output is [z ‖ x‖B‖C ‖ dt] (x‖B‖C adjacent: the convolution's input).
        tensor_size = distributed.tensor_size
        sizes = dict(zip(IN_PROJ_COMPONENTS, (dim.local_size(tensor_size) for dim in in_proj_dim.dims)))
        self._in_proj_sizes = [sizes["z"], sizes["x"] + sizes["b"] + sizes["c"], sizes["dt"]]
        # (local size, multiplier) of each component, in in_proj's output order; none when all are 1.
        multipliers = [config.in_proj_multipliers.get(role, 1.0) for role in IN_PROJ_COMPONENTS]
        self._in_proj_scale = [] if set(multipliers) == {1.0} else list(zip(sizes.values(), multipliers))
        xbc_sizes = tuple(dim.local_size(tensor_size) for dim in convolution_dim.dims)
        self._layout = ScanLayout(xbc_sizes, config.head_size, config.state_size)  # x‖B‖C → the scan's x, B, C

        linear = linear_options(config, distributed, lr_scale, std=hidden_dim.global_size**-0.5)
        self.in_proj = Linear(
            f"{name}.in_proj", [getattr(config, role) for role in IN_PROJ_COMPONENTS], hidden_dim, in_proj_dim, **linear
        )
        self.convolution = CausalConvolution(
            config.convolution,
            name=f"{name}.convolution",
            channels_dim=convolution_dim,
            distributed=distributed,
            lr_scale=lr_scale,
            bias_initialization=ZEROS,  # HF's; mamba_ssm keeps torch's Conv1d initialization.
        )
        self.dt_bias = self._head_parameter("dt_bias", config.dt_bias, DtBiasInitializationConfig(), heads_dim)
        self.a_log = self._head_parameter("a_log", config.a_log, ALogRangeInitializationConfig(), heads_dim)
        self.d = self._head_parameter("d", config.d, ONES, inner_dim if config.d_per_channel else heads_dim)
        # No norm (Falcon-H1's `mamba_rms_norm: false`): no module, no weight; `_output` gates y by z alone.
        self.normalization = (
            GatedRMSNorm(
                config.normalization,
                name=f"{name}.normalization",
                channels=inner_dim,
                group_size=config.norm_group_size,
                distributed=distributed,
                lr_scale=lr_scale,
            )
            if config.normalization.enabled
            else None
        )
        self.out_proj = Linear(f"{name}.out_proj", config.out_proj, inner_dim, hidden_dim, **linear)

    def _head_parameter(
        self, role: str, config: ParameterConfig, initialization: InitializationConfig, dim: TensorDim
    ) -> nn.Parameter:
        settings = config.resolve(initialization=initialization, lr_scale=self.lr_scale, weight_decay=False)
        return create_parameter(f"{self.name}.{role}", (dim,), settings, self.distributed)

    def forward(self, hidden: torch.Tensor, batch: Batch, state: Mamba2State | None = None) -> torch.Tensor:
        if state is not None:
            state.check(batch, f"mamba_2 {self.name!r}")
        z, xbc, dt = self._project(hidden)
        if state is None and self.config.recompute_convolution:
            weight, bias = self.convolution.weight, self.convolution.bias
            y = convolved_ssd_scan(xbc, weight, bias, dt, self._a(), batch, self._layout, **self._scan_options())
            return self._output(y, z)
        xbc = self.convolution(xbc, batch, activation="silu", state=None if state is None else state.convolution)
        y = ssd_scan(
            *self._scan_inputs(xbc, dt), batch, **self._scan_options(), state=None if state is None else state.ssm
        )
        return self._output(y, z)

    def forward_slice(
        self, hidden: torch.Tensor, batch: Batch, previous: SSMCarry | None
    ) -> tuple[torch.Tensor, SSMCarry]:
        """`Mixer.forward_slice`: the convolution and the SSD scan continue `previous` (`blockzoo_ssm.slices`)."""
        previous_inputs, previous_state = (None, None) if previous is None else previous
        z, xbc, dt = self._project(hidden)
        xbc, convolution = self.convolution.forward_slice(xbc, batch, previous_inputs, activation="silu")
        y, ssm = ssd_scan_slice(*self._scan_inputs(xbc, dt), batch, previous_state, **self._scan_options())
        return self._output(y, z), SSMCarry(convolution, ssm)

    def _project(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """[z, x‖B‖C, dt]: views of in_proj's output, never copied on CUDA (the kernels read strided rows); one
        split, so the backward assembles in_proj's gradient in one concatenation. With `in_proj_multipliers`, each
        component's channels are scaled first (a copy)."""
        projected = self.in_proj(hidden)
        if self._in_proj_scale:
            scale = torch.cat([projected.new_full((size,), value) for size, value in self._in_proj_scale])
            projected = projected * scale
        return projected.split(self._in_proj_sizes, dim=-1)

    def _output(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """out_proj of the scan's output `[tokens, heads, head_size]` gated by z and normalized (or only gated)."""
        y = y.flatten(1)
        return self.out_proj(y * F.silu(z) if self.normalization is None else self.normalization(y, z))

    def _scan_inputs(self, xbc: torch.Tensor, dt: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(x, dt, A, B, C) of the scan."""
        x, b, c = self._layout.split(xbc)
        return x, dt, self._a(), b, c

    def _a(self) -> torch.Tensor:
        """A = -exp(A_log), in fp32 whatever the compute dtype."""
        return -torch.exp(self.a_log.float())

    def _scan_options(self) -> dict:
        """The skip D and the time step clamp(softplus(dt + dt_bias)) (fp32; on CUDA the scan kernel computes it as
        it reads dt)."""
        config = self.config
        return {
            "chunk_size": config.chunk_size,
            "D": self.d.view(-1, config.head_size) if config.d_per_channel else self.d,
            "dt_bias": self.dt_bias,
            "dt_softplus": True,
            "dt_limit": config.dt_limit,
        }

    def new_state(self, num_sequences: int, max_length: int, device: torch.device, dtype: torch.dtype) -> Mamba2State:
        """Zero states (`max_length` is not needed: the state does not grow with the sequence)."""
        shape = (num_sequences, len(self.dt_bias), self.config.head_size, self.config.state_size)
        return Mamba2State(
            self.convolution.new_state(num_sequences, device, dtype),
            torch.zeros(shape, device=device, dtype=torch.float32),
        )

    def flops(self, batch: Batch) -> tuple[int, int]:
        tokens, config = batch.num_tokens, self.config
        linears = (self.in_proj, self.out_proj)
        forward = sum(linear.forward_flops(tokens) for linear in linears)
        backward = sum(linear.backward_flops(tokens) for linear in linears)
        # The convolution: one multiply-add per tap and channel (x‖B‖C) of each token.
        channels = config.inner_size + 2 * config.groups * config.state_size
        convolution = 2 * config.convolution.kernel_size * channels * tokens
        # The scan counted as its recurrence: per token, each element of each head's head_size × state_size state
        # is decayed and fed dt·x·B (two multiply-adds) and read by C (one). Norm, gate, D and dt are not counted.
        scan = 6 * config.inner_size * config.state_size * tokens
        # Backward: the gradients of the inputs and of the parameters, about twice the forward.
        return forward + convolution + scan, backward + 2 * (convolution + scan)
