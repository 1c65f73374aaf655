"""The Gated DeltaNet mixer over packed documents (Qwen3-Next's linear attention).

in_proj → [q, k, v, z, b, a]; causal depthwise convolution + silu over q‖k‖v (`blockzoo.ssm`'s); β = sigmoid(b),
log α = -exp(A_log) · softplus(a + dt_bias); o = the gated delta rule of (q, k, v, α, β) (`delta_rule`, which
L2-normalises q and k); o = RMSNorm(o) · weight · silu(z) per value head; out_proj(o).

Tensor-parallel layout: every component is laid out key-head-major (value head h reads key head h // (value_heads
/ key_heads)), so splitting the key heads between ranks gives each rank whole key heads and the value heads that
read them. Each in_proj component is split on its own (column-parallel), as are the convolution's channels,
dt_bias and A_log; the norm's weight (shared by the value heads) is replicated, its gradient summed over the
ranks; out_proj is row-parallel.
"""

from __future__ import annotations

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
from blockzoo_gated_delta_net.config import IN_PROJ_COMPONENTS, GatedDeltaNetConfig, OutputNormalizationConfig
from blockzoo_gated_delta_net.delta_rule import gated_delta_rule
from blockzoo_gated_delta_net.slices import gated_delta_rule_slice
from blockzoo_ssm import (
    ALogRangeInitializationConfig,
    CausalConvolution,
    DtBiasInitializationConfig,
    SSMCarry,
    SSMState,
    gated_rms_norm,
)


class GatedDeltaNetState(SSMState):
    """`SSMState` with the delta rule's state `[sequences, value_heads, key_head_size, value_head_size]`."""

    @property
    def recurrent(self) -> torch.Tensor:
        """The delta rule's state (`ssm`) under its own name."""
        return self.ssm


class GatedOutputNorm(nn.Module):
    """RMSNorm(o) · weight · silu(z) over each value head's channels, the weight shared by the heads."""

    def __init__(
        self, config: OutputNormalizationConfig, *, name: str, head_size: int, distributed: Distributed, lr_scale: float
    ):
        super().__init__()
        lr_scale = scaled_lr(lr_scale, config.lr_scale)
        self.epsilon = config.epsilon
        settings = config.weight.resolve(initialization=ONES, lr_scale=lr_scale, weight_decay=False)
        # Each rank normalizes its own heads with it: the gradient is partial, summed over the tensor group.
        dim = TensorDim("value_head_size", head_size)
        self.weight = create_parameter(f"{name}.weight", (dim,), settings, distributed, partial_gradient=True)

    def forward(self, output: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """output, gate: [tokens, heads, head_size]."""
        normalized = gated_rms_norm(output, None, self.weight, epsilon=self.epsilon, group_size=output.shape[-1])
        return normalized * F.silu(gate.float()).to(normalized.dtype)


class GatedDeltaNet(Mixer):
    def __init__(
        self,
        config: GatedDeltaNetConfig,
        *,
        name: str,
        hidden_dim: TensorDim,
        distributed: Distributed,
        lr_scale: float,
    ):
        lr_scale = scaled_lr(lr_scale, config.lr_scale)
        super().__init__(config, name=name, hidden_dim=hidden_dim, distributed=distributed, lr_scale=lr_scale)
        # Key-head-major dims: splitting the key heads splits their value heads and every per-head component alike.
        key_heads_dim = TensorDim("key_heads", config.key_heads, parallel=True)
        group_dim = TensorDim("value_heads_per_key", config.value_heads // config.key_heads)
        key_size_dim = TensorDim("key_head_size", config.key_head_size)
        value_size_dim = TensorDim("value_head_size", config.value_head_size)

        def keys(role: str) -> CompositeTensorDim:
            return CompositeTensorDim(role, (key_heads_dim, key_size_dim))

        def values(role: str) -> CompositeTensorDim:
            return CompositeTensorDim(role, (key_heads_dim, group_dim, value_size_dim))

        def per_value_head(role: str) -> CompositeTensorDim:
            return CompositeTensorDim(role, (key_heads_dim, group_dim))

        in_proj_dims = {
            "q": keys("q"),
            "k": keys("k"),
            "v": values("v"),
            "z": values("z"),
            "b": per_value_head("b"),
            "a": per_value_head("a"),
        }
        in_proj_dim = ConcatenatedTensorDim("in_proj", [in_proj_dims[role] for role in IN_PROJ_COMPONENTS])
        convolution_dim = ConcatenatedTensorDim("convolution", [in_proj_dims[role] for role in ("q", "k", "v")])
        # This rank's in_proj output is [q‖k‖v ‖ z ‖ b ‖ a] (q‖k‖v adjacent: the convolution's input).
        tensor_size = distributed.tensor_size
        sizes = dict(zip(IN_PROJ_COMPONENTS, (dim.local_size(tensor_size) for dim in in_proj_dim.dims)))
        self._in_proj_sizes = [sizes["q"] + sizes["k"] + sizes["v"], sizes["z"], sizes["b"], sizes["a"]]
        self._qkv_sizes = [sizes["q"], sizes["k"], sizes["v"]]

        linear = linear_options(config, distributed, lr_scale, std=hidden_dim.global_size**-0.5)
        self.in_proj = Linear(
            f"{name}.in_proj", [getattr(config, role) for role in IN_PROJ_COMPONENTS], hidden_dim, in_proj_dim, **linear
        )
        # The shared convolution's bias is on unless disabled; this mixer's is off unless enabled (the references').
        convolution = config.convolution
        if convolution.bias.enabled is None:
            convolution = attrs.evolve(convolution, bias=attrs.evolve(convolution.bias, enabled=False))
        self.convolution = CausalConvolution(
            convolution,
            name=f"{name}.convolution",
            channels_dim=convolution_dim,
            distributed=distributed,
            lr_scale=lr_scale,
            bias_initialization=ZEROS,
        )
        value_heads_dim = per_value_head("value_heads")
        self.dt_bias = self._head_parameter("dt_bias", config.dt_bias, DtBiasInitializationConfig(), value_heads_dim)
        self.a_log = self._head_parameter("a_log", config.a_log, ALogRangeInitializationConfig(), value_heads_dim)
        self.normalization = GatedOutputNorm(
            config.normalization,
            name=f"{name}.normalization",
            head_size=config.value_head_size,
            distributed=distributed,
            lr_scale=lr_scale,
        )
        self.out_proj = Linear(f"{name}.out_proj", config.out_proj, values("values"), hidden_dim, **linear)

    def _head_parameter(
        self, role: str, config: ParameterConfig, initialization: InitializationConfig, dim: TensorDim
    ) -> nn.Parameter:
        settings = config.resolve(initialization=initialization, lr_scale=self.lr_scale, weight_decay=False)
        return create_parameter(f"{self.name}.{role}", (dim,), settings, self.distributed)

    def forward(self, hidden: torch.Tensor, batch: Batch, state: GatedDeltaNetState | None = None) -> torch.Tensor:
        if state is not None:
            state.check(batch, f"gated_delta_net {self.name!r}")
        qkv, z, b, a = self.in_proj(hidden).split(self._in_proj_sizes, dim=-1)
        qkv = self.convolution(qkv, batch, activation="silu", state=None if state is None else state.convolution)
        output = gated_delta_rule(
            *self._rule_inputs(qkv, b, a),
            batch,
            chunk_size=self.config.chunk_size,
            state=None if state is None else state.recurrent,
        )
        return self._output(output, z)

    def forward_slice(
        self, hidden: torch.Tensor, batch: Batch, previous: SSMCarry | None
    ) -> tuple[torch.Tensor, SSMCarry]:
        """One slice of longer sequences (see `Mixer.forward_slice`): the convolution reads the inputs before the
        slice (exchanged over the sequence-data group as Mamba's are) and the delta rule starts from the state before
        it (`slices.gated_delta_rule_slice`: the ranks compose their slices' maps S ↦ A S + B in order); the carry
        holds the convolution's last inputs and the delta rule's state after the slice."""
        previous_inputs, previous_state = (None, None) if previous is None else previous
        qkv, z, b, a = self.in_proj(hidden).split(self._in_proj_sizes, dim=-1)
        qkv, convolution = self.convolution.forward_slice(qkv, batch, previous_inputs, activation="silu")
        output, state = gated_delta_rule_slice(
            *self._rule_inputs(qkv, b, a), batch, previous_state, chunk_size=self.config.chunk_size
        )
        return self._output(output, z), SSMCarry(convolution, state)

    def _rule_inputs(self, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q, k, v, log α, β) of the delta rule, per head, from the convolution's output and in_proj's b and a."""
        config = self.config
        q, k, v = qkv.split(self._qkv_sizes, dim=-1)
        # The decay in fp32 whatever the compute dtype (exp(A_log) of a bf16 A_log loses the decay's precision).
        log_decay = -self.a_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return (
            q.unflatten(-1, (-1, config.key_head_size)),
            k.unflatten(-1, (-1, config.key_head_size)),
            v.unflatten(-1, (-1, config.value_head_size)),
            log_decay,
            b.sigmoid(),
        )

    def _output(self, output: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        output = self.normalization(output, z.unflatten(-1, (-1, self.config.value_head_size)))
        return self.out_proj(output.flatten(1))

    def new_state(
        self, num_sequences: int, max_length: int, device: torch.device, dtype: torch.dtype
    ) -> GatedDeltaNetState:
        """Zero states (`max_length` is not needed: the state does not grow with the sequence)."""
        shape = (num_sequences, len(self.dt_bias), self.config.key_head_size, self.config.value_head_size)
        return GatedDeltaNetState(
            self.convolution.new_state(num_sequences, device, dtype),
            torch.zeros(shape, device=device, dtype=torch.float32),
        )

    def flops(self, batch: Batch) -> tuple[int, int]:
        tokens, config = batch.num_tokens, self.config
        linears = (self.in_proj, self.out_proj)
        forward = sum(linear.forward_flops(tokens) for linear in linears)
        backward = sum(linear.backward_flops(tokens) for linear in linears)
        convolution_forward, convolution_backward = self.convolution.flops(tokens)
        # The delta rule counted as its recurrence on the real tokens: per token and value head, the key_head_size ×
        # value_head_size state is decayed (one multiply), read by k (a multiply-add), updated by k uᵀ (a
        # multiply-add) and read by q (a multiply-add): 7 operations per element. Norms, gates and l2 norms are not
        # counted.
        recurrence = 7 * config.value_heads * config.key_head_size * config.value_head_size * tokens
        # Backward: the gradients of the inputs and of the parameters, about twice the forward.
        return forward + convolution_forward + recurrence, backward + convolution_backward + 2 * recurrence
