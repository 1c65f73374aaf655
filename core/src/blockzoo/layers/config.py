"""Configs of the pieces every layer is made of: parameters, linears, normalizations, and the mixer / MLP kinds.

The contract of DESIGN.md "Layers": every weight comes from a `ParameterConfig`, every linear from a
`LinearConfig`. A field left `None` takes the default its parent passes when the layer is built:
`initialization` and `weight_decay` are replaced, `lr_scale` multiplies down the tree (0 freezes),
`bias.enabled` comes from the mixer's or MLP's `add_linear_biases`, `apply_peft` likewise.
Torch-free: the layers that use these live beside this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import attrs

from blockzoo.config import Config, PolymorphicConfig, at_least, check, configclass, field

# ---------------------------------------------------------------------------------------------------------------------
# Initializations


@configclass
class InitializationConfig(PolymorphicConfig):
    """How a parameter is initialized. Plugins register their own types (kind `initialization`)."""

    kind: ClassVar[str] = "initialization"
    default_type: ClassVar[str] = "normal"


@configclass
class NormalInitializationConfig(InitializationConfig):
    """Values drawn from a normal distribution (optionally truncated)."""

    mean: float = field(0.0, doc="Mean of the normal distribution.")
    std: float = field(0.02, doc="Standard deviation.", validator=at_least(0))
    truncate: float | None = field(None, doc="If set, values are truncated to mean ± truncate·std.")


@configclass
class UniformInitializationConfig(InitializationConfig):
    """Values drawn uniformly from [low, high]."""

    low: float = field(-0.02, doc="Lower bound.")
    high: float = field(0.02, doc="Upper bound.")

    def __attrs_post_init__(self) -> None:
        check(self.low <= self.high, "high", f"must be >= low ({self.low}), got {self.high}")


@configclass
class FillInitializationConfig(InitializationConfig):
    """Every element set to one value (`ZEROS`, `ONES`)."""

    value: float = field(0.0, doc="Every element is set to this value.")


ZEROS = FillInitializationConfig(value=0.0)
ONES = FillInitializationConfig(value=1.0)


# ---------------------------------------------------------------------------------------------------------------------
# Parameters and linears


@attrs.frozen(kw_only=True)
class ResolvedParameter:
    """A parameter's settings once the parent's defaults are applied: what the parameter factory uses."""

    initialization: InitializationConfig
    lr_scale: float
    weight_decay: bool

    @property
    def frozen(self) -> bool:
        return self.lr_scale == 0


def scaled_lr(parent: float, own: float | None) -> float:
    """A part's learning-rate scale: its parent's times its own `lr_scale` (None: the parent's; 0 freezes)."""
    return parent * (1.0 if own is None else own)


@configclass
class ParameterConfig(Config):
    """How one parameter is initialized and trained; each None takes the parent layer's default (`resolve`)."""

    initialization: InitializationConfig | None = field(None, doc="None: the parent layer's default.")
    lr_scale: float | None = field(
        None, doc="Multiplies the parent's learning-rate scale; 0 freezes.", validator=at_least(0)
    )
    weight_decay: bool | None = field(None, doc="Apply the optimizer's weight decay. None: the parent's default.")

    def resolve(
        self, *, initialization: InitializationConfig, lr_scale: float = 1.0, weight_decay: bool = True
    ) -> ResolvedParameter:
        return ResolvedParameter(
            initialization=self.initialization if self.initialization is not None else initialization,
            lr_scale=scaled_lr(lr_scale, self.lr_scale),
            weight_decay=weight_decay if self.weight_decay is None else self.weight_decay,
        )


@configclass
class BiasConfig(ParameterConfig):
    """A linear's bias: a parameter that may be switched off."""

    enabled: bool | None = field(None, doc="None: the parent's default (`add_linear_biases`).")


@configclass
class LinearConfig(Config):
    """A linear layer's weight, bias, learning-rate scale and PEFT switch, each defaulting to its parent's."""

    weight: ParameterConfig = field(factory=ParameterConfig, doc="The weight.")
    bias: BiasConfig = field(factory=BiasConfig, doc="The bias (zeros and no weight decay by default).")
    lr_scale: float | None = field(
        None, doc="Multiplies the parent's learning-rate scale; 0 freezes.", validator=at_least(0)
    )
    apply_peft: bool | None = field(None, doc="Wrap this linear with the model's PEFT method. None: parent default.")
    fp8: bool = field(
        True, doc="With `training.fp8`, compute this linear's products in FP8; false keeps the compute dtype."
    )

    def scaled(self, lr_scale: float) -> float:
        return scaled_lr(lr_scale, self.lr_scale)

    def resolve_weight(self, *, initialization: InitializationConfig, lr_scale: float = 1.0) -> ResolvedParameter:
        return self.weight.resolve(initialization=initialization, lr_scale=self.scaled(lr_scale))

    def has_bias(self, default: bool) -> bool:
        """Whether this linear has a bias: its `bias.enabled`, else `default` (the parent's `add_linear_biases`)."""
        return default if self.bias.enabled is None else self.bias.enabled

    def resolve_bias(self, *, enabled: bool, lr_scale: float = 1.0) -> ResolvedParameter | None:
        """The bias settings, or None when this linear has no bias (`enabled`: the parent's default)."""
        if not self.has_bias(enabled):
            return None
        return self.bias.resolve(initialization=ZEROS, lr_scale=self.scaled(lr_scale), weight_decay=False)

    def use_peft(self, default: bool) -> bool:
        return default if self.apply_peft is None else self.apply_peft


def check_fused_biases(components: Mapping[str, LinearConfig], default: bool, *, weight: str = "in_proj") -> None:
    """The components of one fused weight (their configs by field name, in row order) all have a bias or none, since
    the weight has one bias for all its rows or none: else a `ConfigFieldError` at the first component that differs
    from the first, listing each one's. `default`: the parent's `add_linear_biases`."""
    biases = {name: linear.has_bias(default) for name, linear in components.items()}
    names = list(biases)
    listed = f"{', '.join(names[:-1])} and {names[-1]}" if len(names) > 1 else names[0]
    for name in names[1:]:
        check(
            biases[name] == biases[names[0]],
            f"{name}.bias.enabled",
            f"{listed} are one fused {weight} weight: all have a bias or none "
            f"({', '.join(f'{key}: {value}' for key, value in biases.items())})",
        )


# ---------------------------------------------------------------------------------------------------------------------
# Normalizations


@configclass
class NormalizationConfig(PolymorphicConfig):
    """Base of the normalization types (`rms_norm` by default); a plugin may register more."""

    kind: ClassVar[str] = "normalization"
    default_type: ClassVar[str] = "rms_norm"


@configclass
class NoNormalizationConfig(NormalizationConfig):
    """The identity."""


@configclass
class RMSNormalizationConfig(NormalizationConfig):
    epsilon: float = field(1.0e-5, doc="Added to the mean square before the square root.", validator=at_least(0))
    weight: ParameterConfig = field(factory=ParameterConfig, doc="The scale (ones by default, no weight decay).")
    lr_scale: float | None = field(
        None, doc="Multiplies the parent's learning-rate scale; 0 freezes.", validator=at_least(0)
    )


@configclass
class LayerNormalizationConfig(RMSNormalizationConfig):
    bias: ParameterConfig = field(factory=ParameterConfig, doc="The shift (zeros by default, no weight decay).")


# ---------------------------------------------------------------------------------------------------------------------
# Mixer and MLP kinds: plugins provide the concrete types.

# Activations of MLPs (implemented in `blockzoo.layers.activations`); gelu is the exact, erf-based one.
Activation = Literal["silu", "gelu", "relu", "squared_relu", "identity"]


def default_activation(config: Any) -> str:
    """silu for a gated MLP, else gelu. Use as `attrs.Factory(default_activation, takes_self=True)`: derived, so
    it follows `gated` when an update changes it (unless the activation was given)."""
    return "silu" if config.gated else "gelu"


# What a layer can do, declared by its config class; a run that needs more is refused before it starts.
TENSOR_PARALLEL = "tensor_parallel"
SEQUENCE_TENSOR_PARALLEL = "sequence_tensor_parallel"
SEQUENCE_DATA_PARALLEL = "sequence_data_parallel"
GENERATION_CACHE = "generation_cache"
ALL_CAPABILITIES = frozenset({TENSOR_PARALLEL, SEQUENCE_TENSOR_PARALLEL, SEQUENCE_DATA_PARALLEL, GENERATION_CACHE})


class _LayerConfig(PolymorphicConfig):
    capabilities: ClassVar[frozenset[str]] = frozenset()

    def __attrs_pre_init__(self) -> None:
        if type(self) in (MixerConfig, MLPConfig):  # a base class, guessed for a layer's config
            kind = type(self).kind
            from blockzoo.plugins import get_registry

            registry = get_registry(strict=False)
            types = ", ".join(
                f"{entry.name}: {entry.config_class.__module__}.{entry.config_class.__name__}"
                for entry in registry.entries(kind)
            )
            raise TypeError(
                f"{type(self).__name__} is the base class of the configs of every {kind} type, not one to configure: "
                f"build the config of a {kind} type (installed: {types or 'none'})"
            )

    def check_tensor_parallel(self, tensor_parallel: int) -> None:
        """Raise `ConfigFieldError(field, message)` if this layer cannot be split between `tensor_parallel` ranks
        (e.g. a dimension they do not divide), so the run is refused before anything is built."""

    def check_sequence_data_parallel(self) -> None:
        """Raise `ConfigFieldError(field, message)` if this layer, which declares sequence_data_parallel, cannot run
        over slices of sequences with these settings (e.g. attention that is not causal: a token would see later
        slices), so a run with sequence_data_parallel or micro_sequence_length is refused before it starts."""


@configclass
class MixerConfig(_LayerConfig):
    """Mixes information across tokens (attention, SSMs). Kind `mixer`, default type `attention`."""

    kind: ClassVar[str] = "mixer"
    default_type: ClassVar[str] = "attention"


@configclass
class MLPConfig(_LayerConfig):
    """Transforms each token (dense MLP, MoE). Kind `mlp`, default type `mlp`."""

    kind: ClassVar[str] = "mlp"
    default_type: ClassVar[str] = "mlp"


@configclass
class NoMixerConfig(MixerConfig):
    """No mixer: the block's mixer part is skipped (a NemotronH-style MLP-only layer)."""

    capabilities: ClassVar[frozenset[str]] = ALL_CAPABILITIES


@configclass
class NoMLPConfig(MLPConfig):
    """No MLP: the block's MLP part is skipped (Mamba-style blocks)."""

    capabilities: ClassVar[frozenset[str]] = ALL_CAPABILITIES
