"""The Mamba 1 mixer over packed documents: in_proj, causal convolution, time step, B and C, the selective scan
(`blockzoo_ssm.selective_scan`), the D skip, the z gate and out_proj. Both layouts of `MambaConfig`.

Tensor-parallel layout: the inner channels are split (grouped layout: whole heads of state_size channels, the x/B
heads with the C heads they serve). in_proj and dt_proj are column-parallel, out_proj row-parallel; the
convolution, dt_bias, A_log and D are split by channel. The standard layout's x_proj reads the split channels, so it
is row-parallel: its output (dt, B, C) lands like the residual stream (all tokens on every rank, or this rank's
tokens under sequence-tensor-parallel), where the dt/B/C norms act; dt then enters the tensor region through
dt_proj, and B and C through the same entry (`copy_to_tensor_region` / `gather_tokens`). In the grouped layout dt
comes from the hidden states through the replicated dt_in_proj, B and C from in_proj. The scan sees every token.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from blockzoo.api import (
    ONES,
    ZEROS,
    Batch,
    CompositeTensorDim,
    ConcatenatedTensorDim,
    ConfigFieldError,
    Distributed,
    FillInitializationConfig,
    InitializationConfig,
    Linear,
    Mixer,
    NormalizationConfig,
    TensorDim,
    UniformInitializationConfig,
    copy_to_tensor_region,
    create_parameter,
    gather_tokens,
    get_registry,
    linear_options,
    scaled_lr,
)
from blockzoo_mamba.config import MambaConfig
from blockzoo_ssm import (
    ALogStateInitializationConfig,
    CausalConvolution,
    DtBiasInitializationConfig,
    SSMCarry,
    SSMState,
    selective_scan,
    selective_scan_slice,
)


class MambaState(SSMState):
    """`SSMState` with the scan's state `[sequences, inner, state]`."""


class Mamba(Mixer):
    def __init__(
        self, config: MambaConfig, *, name: str, hidden_dim: TensorDim, distributed: Distributed, lr_scale: float
    ):
        lr_scale = scaled_lr(lr_scale, config.lr_scale)
        super().__init__(config, name=name, hidden_dim=hidden_dim, distributed=distributed, lr_scale=lr_scale)
        hidden_size, tensor_size = hidden_dim.global_size, distributed.tensor_size
        try:
            config.check_hidden_size(hidden_size, tensor_size)
        except ConfigFieldError as error:
            raise ValueError(f"mamba {name!r}: {error.field_name}: {error.message}") from None
        inner_size = config.resolved_inner_size(hidden_size)
        self._dt_rank = config.resolved_dt_rank(hidden_size)
        state_size = config.state_size
        state_dim = TensorDim("state", state_size)
        dt_rank_dim = TensorDim("dt_rank", self._dt_rank)

        if config.grouped:
            heads_dim = TensorDim("heads", inner_size // state_size, parallel=True)
            xb_heads_dim = TensorDim("xb_heads", config.xb_size // state_size, parallel=True)
            self._repeats = heads_dim.global_size // xb_heads_dim.global_size
            inner_dim = CompositeTensorDim("inner", (heads_dim, state_dim))
            xb_dim = CompositeTensorDim("xb", (xb_heads_dim, state_dim))
            in_proj_dims = {
                "z": CompositeTensorDim("z", (heads_dim, state_dim)),
                "x": CompositeTensorDim("x", (xb_heads_dim, state_dim)),
                "b": CompositeTensorDim("b", (xb_heads_dim, state_dim)),
                "c": CompositeTensorDim("c", (heads_dim, state_dim)),
            }
            convolution_dim = inner_dim if config.repeat_xb_before_convolution else xb_dim
        else:
            inner_dim = TensorDim("inner", inner_size, parallel=True)
            in_proj_dims = {part: TensorDim(part, inner_size, parallel=True) for part in ("x", "z")}
            convolution_dim = inner_dim
        self._inner_dim, self._convolution_dim = inner_dim, convolution_dim
        in_proj_dim = ConcatenatedTensorDim("in_proj", [in_proj_dims[part] for part in config.in_proj_components])
        self._in_proj_slices = dict(zip(config.in_proj_components, in_proj_dim.component_slices(tensor_size)))

        linear = linear_options(config, distributed, lr_scale, std=hidden_size**-0.5)
        components = [getattr(config, component) for component in config.in_proj_components]
        self.in_proj = Linear(f"{name}.in_proj", components, hidden_dim, in_proj_dim, **linear)
        self.convolution = CausalConvolution(
            config.convolution,
            name=f"{name}.convolution",
            channels_dim=convolution_dim,
            distributed=distributed,
            lr_scale=lr_scale,
            bias_initialization=ZEROS,
        )
        if config.grouped:
            self.dt_in_proj = Linear(f"{name}.dt_in_proj", config.dt_in_proj, hidden_dim, dt_rank_dim, **linear)
        else:
            # Row-parallel (it reads the split channels); mamba_ssm's x_proj has no bias.
            x_proj_dim = TensorDim("x_proj", self._dt_rank + 2 * state_size)
            self.x_proj = Linear(
                f"{name}.x_proj", config.x_proj, inner_dim, x_proj_dim, **{**linear, "default_bias": False}
            )
        self.dt_proj = Linear(
            f"{name}.dt_proj",
            config.dt_proj,
            dt_rank_dim,
            inner_dim,
            **{**linear, "default_initialization": self._dt_proj_initialization(), "default_bias": False},
        )
        self.dt_bias = None
        if config.has_dt_bias:
            settings = config.dt_bias.resolve(
                initialization=DtBiasInitializationConfig(), lr_scale=lr_scale, weight_decay=False
            )
            self.dt_bias = create_parameter(f"{name}.dt_bias", (inner_dim,), settings, distributed)
        a_log = config.a_log.resolve(
            initialization=ALogStateInitializationConfig(), lr_scale=lr_scale, weight_decay=False
        )
        self.a_log = create_parameter(f"{name}.a_log", (inner_dim, state_dim), a_log, distributed)
        d = config.d.resolve(initialization=ONES, lr_scale=lr_scale, weight_decay=False)
        self.d = create_parameter(f"{name}.d", (inner_dim,), d, distributed)
        self.out_proj = Linear(f"{name}.out_proj", config.out_proj, inner_dim, hidden_dim, **linear)

        # In the grouped layout B and C come from in_proj: their norms see this rank's heads only (partial gradients).
        self.dt_norm = self._norm(config.dt_norm, "dt_norm", dt_rank_dim, partial=False)
        self.b_norm = self._norm(config.b_norm, "b_norm", state_dim, partial=config.grouped)
        self.c_norm = self._norm(config.c_norm, "c_norm", state_dim, partial=config.grouped)

    def _dt_proj_initialization(self) -> InitializationConfig:
        scale = self._dt_rank**-0.5 * self.config.dt_scale
        if self.config.dt_init == "constant":
            return FillInitializationConfig(value=scale)
        return UniformInitializationConfig(low=-scale, high=scale)

    def _norm(self, config: NormalizationConfig | None, role: str, dim: TensorDim, partial: bool) -> nn.Module | None:
        implementation = None if config is None else get_registry().implementation_of(config)
        if implementation is None:
            return None
        norm = implementation(
            config, name=f"{self.name}.{role}", hidden_dim=dim, distributed=self.distributed, lr_scale=self.lr_scale
        )
        if partial:
            for parameter in norm.parameters():
                parameter.meta = attrs.evolve(
                    parameter.meta, reduce_gradient_over_tensor_group=self.distributed.tensor_size > 1
                )
        return norm

    # -- forward -------------------------------------------------------------------------------------------------------

    def forward(self, hidden: torch.Tensor, batch: Batch, state: MambaState | None = None) -> torch.Tensor:
        if state is not None:
            state.check(batch, f"mamba {self.name!r}")
        convolution_state = None if state is None else state.convolution

        def convolve(x: torch.Tensor) -> tuple[torch.Tensor, None]:
            return self.convolution(x, batch, activation="silu", state=convolution_state), None

        parts, (x, delta, a, b, c), _ = self._scan_inputs(hidden, convolve)
        y = selective_scan(x, delta, a, b, c, batch, state=None if state is None else state.ssm)
        return self._output(y, x, parts["z"], hidden.dtype)

    def forward_slice(
        self, hidden: torch.Tensor, batch: Batch, previous: SSMCarry | None
    ) -> tuple[torch.Tensor, SSMCarry]:
        """`Mixer.forward_slice`: the convolution and the selective scan continue `previous` (`blockzoo_ssm.slices`)."""
        previous_inputs, previous_state = (None, None) if previous is None else previous

        def convolve(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.convolution.forward_slice(x, batch, previous_inputs, activation="silu")

        parts, (x, delta, a, b, c), convolution = self._scan_inputs(hidden, convolve)
        y, ssm = selective_scan_slice(x, delta, a, b, c, batch, previous_state)
        return self._output(y, x, parts["z"], hidden.dtype), SSMCarry(convolution, ssm)

    def _scan_inputs(self, hidden: torch.Tensor, convolve: Callable):
        """(in_proj's parts, the scan's inputs (x, delta, A, B, C), what `convolve` returned beside its output).
        `convolve(x) -> (convolved x, anything)` runs the causal convolution."""
        projected = self.in_proj(hidden)
        parts = {component: projected[:, rows] for component, rows in self._in_proj_slices.items()}
        if self.config.grouped:
            x, dt, b, c, convolved = self._grouped_inputs(hidden, parts, convolve)
        else:
            x, dt, b, c, convolved = self._standard_inputs(parts, convolve)
        delta = self.dt_proj(dt).float()
        if self.dt_bias is not None:
            delta = delta + self.dt_bias.float()
        return parts, (x, F.softplus(delta), -torch.exp(self.a_log.float()), b, c), convolved

    def _output(self, y: torch.Tensor, x: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        y = (y.float() + x.float() * self.d.float()) * F.silu(z.float())
        return self.out_proj(y.to(dtype))

    def _standard_inputs(self, parts: dict, convolve: Callable):
        """x (convolved), dt (residual-stream layout), B and C [tokens, 1, state] (every token), what `convolve`
        returned beside x."""
        x, convolved = convolve(parts["x"])
        state_size = self.config.state_size
        dt, b, c = self.x_proj(x).split([self._dt_rank, state_size, state_size], dim=-1)
        dt = self._normalized(self.dt_norm, dt)
        b_c = self._enter_tensor_region(
            torch.cat([self._normalized(self.b_norm, b), self._normalized(self.c_norm, c)], -1)
        )
        return x, dt, b_c[:, None, :state_size], b_c[:, None, state_size:], convolved

    def _grouped_inputs(self, hidden: torch.Tensor, parts: dict, convolve: Callable):
        """x (convolved, repeated to every head), dt, B (repeated) and C [tokens, heads, state], what `convolve`
        returned beside x."""
        dt = self._normalized(self.dt_norm, self.dt_in_proj(hidden))
        if self.config.repeat_xb_before_convolution:
            x, convolved = convolve(self._repeat_heads(parts["x"]))
        else:
            x, convolved = convolve(parts["x"])
            x = self._repeat_heads(x)
        state_size = self.config.state_size
        b = self._normalized(self.b_norm, parts["b"].unflatten(-1, (-1, state_size)))
        c = self._normalized(self.c_norm, parts["c"].unflatten(-1, (-1, state_size)))
        return x, dt, b.repeat_interleave(self._repeats, dim=1), c, convolved

    def _repeat_heads(self, x: torch.Tensor) -> torch.Tensor:
        """x/B head g serves the C heads g·repeats ... (g + 1)·repeats - 1 (HF's `repeat_kv` order)."""
        return x.unflatten(-1, (-1, self.config.state_size)).repeat_interleave(self._repeats, dim=1).flatten(1)

    def _enter_tensor_region(self, tensor: torch.Tensor) -> torch.Tensor:
        group = self.distributed.tensor_group
        if self.distributed.sequence_tensor_parallel:
            return gather_tokens(tensor, group)
        return copy_to_tensor_region(tensor, group)

    @staticmethod
    def _normalized(norm: nn.Module | None, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if norm is None else norm(tensor)

    # -- generation ----------------------------------------------------------------------------------------------------

    def new_state(self, num_sequences: int, max_length: int, device: torch.device, dtype: torch.dtype) -> MambaState:
        """The state does not grow with the sequence: `max_length` is not needed."""
        shape = (num_sequences, self._inner_dim.local_size(self.distributed.tensor_size), self.config.state_size)
        return MambaState(
            self.convolution.new_state(num_sequences, device, dtype),
            torch.zeros(shape, device=device, dtype=torch.float32),
        )

    # -- compute -------------------------------------------------------------------------------------------------------

    def flops(self, batch: Batch) -> tuple[int, int]:
        tokens = batch.num_tokens
        linears = [self.in_proj, self.dt_in_proj if self.config.grouped else self.x_proj, self.dt_proj, self.out_proj]
        forward = sum(linear.forward_flops(tokens) for linear in linears)
        backward = sum(linear.backward_flops(tokens) for linear in linears)
        # Convolution: a multiply-add per tap and channel. Scan, per channel and state entry: exp(Δ·A) 2, Δ·x·B 2,
        # the state update 2, its product with C 2. Backward twice the forward. Element-wise ops are not counted.
        convolution = 2 * self.config.convolution.kernel_size * self._convolution_dim.global_size * tokens
        scan = 8 * self._inner_dim.global_size * self.config.state_size * tokens
        return forward + convolution + scan, backward + 2 * (convolution + scan)
