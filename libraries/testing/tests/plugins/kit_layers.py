"""Layers for the conformance kit's self-tests of its capability checks: a right one and deliberately wrong ones.

`kitrec.decaying_sum`, a gated linear recurrence h_t = a_t ⊙ h_{t-1} + v_t per channel (h = 0 before each document;
v = input(x), a = sigmoid(gate(x)), y = output(h)), declares sequence_data_parallel and passes it through the public
helpers (`blockzoo.api.initial_state_over_ranks`, `depend_on`), as a RetNet-style plugin would. Its wrong variants
are right in one process, one slice after another, and wrong only in what one rank passes another:

- `kitrec.sqrt_decay`: the decay between ranks replaced by its square root;
- `kitrec.drops_received_state`: each rank starts its slice from a zero state (it joins the exchange, uses none of it);
- `kitrec.own_state_as_carry`: the carry to the next step is this rank's own final state, not the group's last.

`kitrec.hides_apply` names a static helper `_apply`, hiding torch's: `.to(...)` raises.

`kitold.decaying_sum` is the right recurrence from a plugin declaring plugin API 1.0 (`register_written_for_old_api`),
which has no sequence-data parallelism: refused at registration.

`kittp.input_scale`: a per-channel input scale before a tensor-parallel projection, declaring tensor_parallel and
sequence_tensor_parallel; `kittp.scale_gradient_not_summed` makes the scale without `token_sharded_input=True`, so
under sequence-tensor parallelism its gradient covers only this rank's tokens.

Registered in-process (`register()`): the test modules that use them add this directory to `sys.path`.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from blockzoo.api import (
    SEQUENCE_DATA_PARALLEL,
    SEQUENCE_TENSOR_PARALLEL,
    TENSOR_PARALLEL,
    Linear,
    LinearConfig,
    Mixer,
    MixerConfig,
    NormalInitializationConfig,
    ParameterConfig,
    PluginInfo,
    TensorDim,
    at_least,
    check,
    configclass,
    create_parameter,
    depend_on,
    field,
    hookimpl,
    initial_state_over_ranks,
)
from blockzoo.plugins import register_plugin

# ---------------------------------------------------------------------------------------------------------------------
# A linear recurrence over slices


@configclass
class DecayingSumConfig(MixerConfig):
    """h_t = a_t ⊙ h_{t-1} + v_t, a = sigmoid(gate(x)), v = input(x), y = output(h); h = 0 before each document."""

    capabilities: ClassVar[frozenset[str]] = frozenset({SEQUENCE_DATA_PARALLEL})

    channels: int = field(4, doc="Width of the state.", validator=at_least(1))


class DecayingSum(Mixer):
    def __init__(self, config, *, name, hidden_dim, distributed, lr_scale):
        super().__init__(config, name=name, hidden_dim=hidden_dim, distributed=distributed, lr_scale=lr_scale)
        channels = TensorDim("channels", config.channels)
        options = {"default_initialization": NormalInitializationConfig(std=0.5), "lr_scale": lr_scale}
        self.input = Linear(f"{name}.input", LinearConfig(), hidden_dim, channels, distributed, **options)
        self.gate = Linear(f"{name}.gate", LinearConfig(), hidden_dim, channels, distributed, **options)
        self.output = Linear(f"{name}.output", LinearConfig(), channels, hidden_dim, distributed, **options)

    def forward(self, hidden, batch, state=None):
        values, decays = self.input(hidden), torch.sigmoid(self.gate(hidden))
        return self.output(scan(values, decays, batch, None)[0])

    def forward_slice(self, hidden, batch, previous):
        values, decays = self.input(hidden), torch.sigmoid(self.gate(hidden))
        group = batch.sequence_data.group
        if group is None or group.size() == 1:  # One slice after another: start from the slice before's state.
            states, final = scan(values, decays, batch, previous if batch.continued else None)
            return self.output(states), final
        states, final = scan(values, decays, batch, None)  # From a zero state; the true one is added below.
        initial, carry = self.combine(final, last_piece_decay(decays, batch), batch, previous)
        if not batch.continued:
            return self.output(depend_on(states, initial)), carry
        # Linear in the state: what the initial state adds is the scan of zero values from it (first piece only).
        states = states + scan(torch.zeros_like(values), decays, batch, initial.to(values.dtype))[0]
        return self.output(states), carry

    def combine(self, final, decay, batch, previous):
        """(this rank's initial state, the carry after the group's last slice)."""
        return initial_state_over_ranks(final, decay, batch, previous)

    def flops(self, batch):
        tokens = batch.num_tokens
        linears = (self.input, self.gate, self.output)
        scanning = 4 * tokens * self.config.channels
        forward = sum(linear.forward_flops(tokens) for linear in linears) + scanning
        return forward, sum(linear.backward_flops(tokens) for linear in linears) + 2 * scanning


def scan(values, decays, batch, initial):
    """(states [tokens, channels], the state after the last token): h restarts from zero at each document start, from
    `initial` (when given) at the first token."""
    starts = set(batch.cu_seqlens[:-1].tolist())
    state = torch.zeros_like(values[0]) if initial is None else initial
    states = []
    for token in range(len(values)):
        if token in starts and (token > 0 or initial is None):
            state = torch.zeros_like(values[token])
        state = decays[token] * state + values[token]
        states.append(state)
    return torch.stack(states), state


def last_piece_decay(decays, batch):
    """The product of the decays of the slice's last piece: how the state entering it is carried to its end when the
    piece is the whole slice (`initial_state_over_ranks` uses it only then)."""
    last = (batch.document_index == batch.num_documents - 1)[:, None]
    return torch.where(last, decays, 1.0).prod(0)


@configclass
class SqrtDecayConfig(DecayingSumConfig):
    """Combines the ranks' states with the square root of each slice's decay."""


class SqrtDecay(DecayingSum):
    def combine(self, final, decay, batch, previous):
        return initial_state_over_ranks(final, decay.sqrt(), batch, previous)


@configclass
class DropsReceivedStateConfig(DecayingSumConfig):
    """Joins the exchange, then starts each slice from a zero state."""


class DropsReceivedState(DecayingSum):
    def combine(self, final, decay, batch, previous):
        initial, carry = initial_state_over_ranks(final, decay, batch, previous)
        return depend_on(torch.zeros_like(initial), initial), carry


@configclass
class OwnStateAsCarryConfig(DecayingSumConfig):
    """Hands the next step this rank's own final state instead of the group's last."""


class OwnStateAsCarry(DecayingSum):
    def combine(self, final, decay, batch, previous):
        initial, carry = initial_state_over_ranks(final, decay, batch, previous)
        own = final + decay * initial if batch.continued and batch.num_documents == 1 else final
        return initial, depend_on(own.to(carry.dtype), carry)


@configclass
class HidesApplyConfig(DecayingSumConfig):
    """Names a static helper `_apply`, hiding nn.Module._apply (what Mamba 1 once did)."""


class HidesApply(DecayingSum):
    def forward(self, hidden, batch, state=None):
        return self._apply(super().forward, hidden, batch)

    @staticmethod
    def _apply(function, *arguments):
        return function(*arguments)


# ---------------------------------------------------------------------------------------------------------------------
# A replicated parameter on token-sharded inputs


@configclass
class InputScaleConfig(MixerConfig):
    """y = output(silu(input(x ⊙ scale))), the scale per hidden channel, input column- and output row-parallel."""

    capabilities: ClassVar[frozenset[str]] = frozenset({TENSOR_PARALLEL, SEQUENCE_TENSOR_PARALLEL})

    channels: int = field(8, doc="Width of the inner layer.", validator=at_least(1))
    scale: ParameterConfig = field(factory=ParameterConfig, doc="The per-channel input scale.")

    def check_tensor_parallel(self, tensor_parallel: int) -> None:
        check(self.channels % tensor_parallel == 0, "channels", f"tensor_parallel={tensor_parallel} must divide it")


class InputScale(Mixer):
    token_sharded = True

    def __init__(self, config, *, name, hidden_dim, distributed, lr_scale):
        super().__init__(config, name=name, hidden_dim=hidden_dim, distributed=distributed, lr_scale=lr_scale)
        channels = TensorDim("channels", config.channels, parallel=True)
        options = {"default_initialization": NormalInitializationConfig(std=0.5), "lr_scale": lr_scale}
        self.input = Linear(f"{name}.input", LinearConfig(), hidden_dim, channels, distributed, **options)
        self.output = Linear(f"{name}.output", LinearConfig(), channels, hidden_dim, distributed, **options)
        settings = config.scale.resolve(initialization=NormalInitializationConfig(mean=1.0, std=0.3), lr_scale=lr_scale)
        self.scale = create_parameter(
            f"{name}.scale", (hidden_dim,), settings, distributed, token_sharded_input=self.token_sharded
        )

    def forward(self, hidden, batch, state=None):
        return self.output(torch.nn.functional.silu(self.input(hidden * self.scale.to(hidden.dtype))))

    def flops(self, batch):
        tokens = batch.num_tokens
        forward = self.input.forward_flops(tokens) + self.output.forward_flops(tokens)
        return forward, self.input.backward_flops(tokens) + self.output.backward_flops(tokens)


@configclass
class ScaleGradientNotSummedConfig(InputScaleConfig):
    """Makes its scale without token_sharded_input=True."""


class ScaleGradientNotSummed(InputScale):
    token_sharded = False


# ---------------------------------------------------------------------------------------------------------------------

RECURRENT = {
    "decaying_sum": (DecayingSumConfig, "DecayingSum"),
    "sqrt_decay": (SqrtDecayConfig, "SqrtDecay"),
    "drops_received_state": (DropsReceivedStateConfig, "DropsReceivedState"),
    "own_state_as_carry": (OwnStateAsCarryConfig, "OwnStateAsCarry"),
    "hides_apply": (HidesApplyConfig, "HidesApply"),
}
TENSOR = {
    "input_scale": (InputScaleConfig, "InputScale"),
    "scale_gradient_not_summed": (ScaleGradientNotSummedConfig, "ScaleGradientNotSummed"),
}


@configclass
class WrittenForOldAPIConfig(DecayingSumConfig):
    """The right recurrence, registered by a plugin that says it was written for plugin API 1.0."""


class _Plugin:
    def __init__(self, prefix, types, capabilities, api_version=(1, 1)):
        self.prefix, self.types, self.capabilities, self.api_version = prefix, types, capabilities, api_version

    @hookimpl
    def plugin_info(self):
        capabilities = tuple(sorted(self.capabilities))
        return PluginInfo(api_version=self.api_version, capabilities=capabilities, description="the kit's test layers")

    @hookimpl
    def register_mixers(self, register):
        for name, (config_class, implementation) in self.types.items():
            register(f"{self.prefix}.{name}", config_class, f"{__name__}:{implementation}")


def register() -> None:
    """Register the layers as plugins `kitrec` and `kittp` (in-process: they are not installed)."""
    register_plugin(_Plugin("kitrec", RECURRENT, DecayingSumConfig.capabilities), "kitrec")
    register_plugin(_Plugin("kittp", TENSOR, InputScaleConfig.capabilities), "kittp")


def register_written_for_old_api(capabilities=(SEQUENCE_DATA_PARALLEL,)) -> None:
    """Register `kitold.decaying_sum` (sequence_data_parallel on its config), from a plugin declaring plugin API 1.0
    and `capabilities` in its plugin_info."""
    types = {"decaying_sum": (WrittenForOldAPIConfig, "DecayingSum")}
    register_plugin(_Plugin("kitold", types, capabilities, api_version=(1, 0)), "kitold")
