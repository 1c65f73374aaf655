"""The configs the SSM mixers share: their initialization types (kind `initialization`, registered by this
distribution's plugin, `blockzoo_ssm.plugin`), their causal convolution, and the checks of the SSD mixers' heads
and B/C groups.

Torch-free, so a mixer's config module can name them as its defaults; the implementations (same signature as
every initialization: `fn(tensor, config, generator)`) are in `blockzoo_ssm.initialization`.
"""

from __future__ import annotations

from blockzoo.config import Config, ConfigFieldError, at_least, check, configclass, field, greater_than
from blockzoo.layers.config import BiasConfig, InitializationConfig, ParameterConfig


@configclass
class DtBiasInitializationConfig(InitializationConfig):
    """The bias of the time step before its softplus, as mamba_ssm's `dt_proj.bias`: softplus⁻¹(dt) with
    dt = exp(U[log min, log max]) clamped below by `floor`, so softplus(bias) starts log-uniform in [min, max]."""

    min: float = field(1.0e-3, doc="Smallest initial time step (before the floor).", validator=greater_than(0))
    max: float = field(0.1, doc="Largest initial time step.", validator=greater_than(0))
    floor: float = field(1.0e-4, doc="Initial time steps are clamped below by this value.", validator=greater_than(0))

    def __attrs_post_init__(self) -> None:
        check(self.min <= self.max, "max", f"must be >= min ({self.min}), got {self.max}")


@configclass
class ALogRangeInitializationConfig(InitializationConfig):
    """log U[low, high]: Mamba 2's A_log, one value per head (A = -exp(A_log) is uniform in [-high, -low])."""

    low: float = field(1.0, doc="Smallest -A.", validator=greater_than(0))
    high: float = field(16.0, doc="Largest -A.", validator=greater_than(0))

    def __attrs_post_init__(self) -> None:
        check(self.low <= self.high, "high", f"must be >= low ({self.low}), got {self.high}")


@configclass
class ALogStateInitializationConfig(InitializationConfig):
    """log(1), log(2), ..., log(N) along the last dimension (of size N): Mamba 1's A_log [channels, state], so
    A = -exp(A_log) is -(n + 1) for state n, the same for every channel (S4D-real)."""


@configclass
class ConvolutionConfig(Config):
    """The causal depthwise convolution of the Mamba mixers: one filter per channel, restarting at every document.

    Its bias is on unless `bias.enabled: false` (the references' `conv_bias=True`), whatever the mixer's
    `add_linear_biases` says; its default initialization is the mixer's (see its docs).
    """

    kernel_size: int = field(
        4,
        doc="Taps of each filter, the current token included (mamba_ssm `d_conv`, HF `conv_kernel`).",
        validator=at_least(1),
    )
    weight: ParameterConfig = field(
        factory=ParameterConfig,
        doc="The filters, [channels, kernel_size]. Default initialization uniform(±kernel_size^-0.5): torch's Conv1d "
        "default, which the references use.",
    )
    bias: BiasConfig = field(factory=BiasConfig, doc="One per channel; no weight decay by default.")
    lr_scale: float | None = field(
        None, doc="Multiplies the mixer's learning-rate scale; 0 freezes.", validator=at_least(0)
    )

    @property
    def has_bias(self) -> bool:
        return self.bias.enabled is not False


def check_head_groups(heads: int, groups: int) -> None:
    """The heads share the B/C groups evenly (head h reads group h // (heads / groups)); else ConfigFieldError on
    `groups`."""
    check(groups <= heads, "groups", f"must be <= heads ({heads}), got {groups}")
    check(heads % groups == 0, "groups", f"must divide heads ({heads}), got {groups}")


def check_groups_tensor_parallel(groups: int, tensor_parallel: int) -> None:
    """Tensor-parallel ranks hold whole B/C groups with their heads (`blockzoo_ssm.dims`); else ConfigFieldError on
    `groups`."""
    if groups % tensor_parallel:
        raise ConfigFieldError(
            "groups",
            f"tensor_parallel={tensor_parallel} must divide groups ({groups}): heads and their B/C groups are split "
            "between tensor-parallel ranks (raise groups, as mamba_ssm requires too)",
        )
