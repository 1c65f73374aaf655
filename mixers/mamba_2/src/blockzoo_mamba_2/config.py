"""Config of the Mamba 2 (SSD) mixer (`type: mamba_2`). Torch-free, like every plugin's config module.

Names of the references each field matches: mamba_ssm's `Mamba2` module (`modules/mamba2.py`) and Hugging Face's
`Mamba2Mixer` / NemotronH / Bamba.
"""

from __future__ import annotations

import math
from typing import ClassVar

from blockzoo.api import (
    GENERATION_CACHE,
    SEQUENCE_DATA_PARALLEL,
    SEQUENCE_TENSOR_PARALLEL,
    TENSOR_PARALLEL,
    Config,
    ConfigFieldError,
    LinearConfig,
    MixerConfig,
    ParameterConfig,
    at_least,
    check,
    check_fused_biases,
    configclass,
    field,
)
from blockzoo_ssm import ConvolutionConfig, check_groups_tensor_parallel, check_head_groups

# The components of the fused input projection, in mamba_ssm's (and HF's) row order.
IN_PROJ_COMPONENTS = ("z", "x", "b", "c", "dt")


@configclass
class GatedNormalizationConfig(Config):
    """The scan's output y gated by z and normalized: RMSNorm(y · silu(z)) · weight by default (mamba_ssm
    `norm_before_gate=False`), RMSNorm(y) · weight · silu(z) with `norm_before_gate`, or no norm at all, y · silu(z),
    with `enabled: false` (Falcon-H1's `mamba_rms_norm: false`)."""

    enabled: bool = field(
        True,
        doc="false: no norm and no weight, y · silu(z) goes to out_proj (Falcon-H1 `mamba_rms_norm: false`); "
        "epsilon, per_group, weight and lr_scale then have no effect.",
    )
    norm_before_gate: bool = field(
        False,
        doc="true: normalize y, then gate, RMSNorm(y) · weight · silu(z) (mamba_ssm and Falcon-H1 "
        "`norm_before_gate`); false: gate, then normalize, RMSNorm(y · silu(z)) · weight (mamba_ssm `Mamba2`, HF "
        "`Mamba2`, NemotronH, Bamba). Needs `enabled`.",
    )
    epsilon: float = field(
        1.0e-5, doc="Added to the mean square (mamba_ssm 1e-5, HF `layer_norm_epsilon`).", validator=at_least(0)
    )
    per_group: bool = field(
        True,
        doc="true: statistics over each B/C group's channels, (heads / groups) · head_size of them (mamba_ssm "
        "`Mamba2`, NemotronH, Zamba2, FalconH1). false: over the whole inner dimension (HF `Mamba2`, Bamba, "
        "GraniteMoeHybrid). The same when groups is 1.",
    )
    weight: ParameterConfig = field(
        factory=ParameterConfig, doc="The scale, one per inner channel (ones by default, no weight decay)."
    )
    lr_scale: float | None = field(
        None, doc="Multiplies the mixer's learning-rate scale; 0 freezes.", validator=at_least(0)
    )

    def __attrs_post_init__(self) -> None:
        check(
            self.enabled or not self.norm_before_gate,
            "norm_before_gate",
            "true orders a norm and the gate, but there is no norm (enabled is false)",
        )


def _in_proj_doc(role: str) -> str:
    return f"The rows of the fused input projection `in_proj` computing {role}. Bias default: `add_linear_biases`."


@configclass
class Mamba2Config(MixerConfig):
    """Mamba 2 (SSD): in_proj → [z, x, B, C, dt]; causal conv + silu over x‖B‖C; dt = clamp(softplus(dt + dt_bias));
    the SSD scan with A = -exp(A_log) per head; + D·x; RMSNorm(y · silu(z)) (or a variant: `normalization`); out_proj.

    Head h reads B/C group h // (heads / groups). The inner dimension is heads · head_size, independent of the
    hidden size (mamba_ssm: expand · d_model = nheads · headdim).
    Tensor-parallel: heads and groups are split (tensor_parallel must divide groups), so are the in_proj
    components, the convolution's channels, dt_bias, A_log, D and the norm; out_proj is row-parallel.
    """

    capabilities: ClassVar[frozenset[str]] = frozenset(
        {TENSOR_PARALLEL, SEQUENCE_TENSOR_PARALLEL, SEQUENCE_DATA_PARALLEL, GENERATION_CACHE}
    )

    heads: int = field(
        8, doc="SSM heads, each with its own dt, A and D (mamba_ssm `nheads`, HF `num_heads`).", validator=at_least(1)
    )
    head_size: int = field(64, doc="Channels of each head (mamba_ssm `headdim`, HF `head_dim`).", validator=at_least(1))
    groups: int = field(
        1,
        doc="B/C groups, each shared by heads / groups heads (mamba_ssm `ngroups`, HF `n_groups`). Must divide heads.",
        validator=at_least(1),
    )
    state_size: int = field(
        128, doc="State size per channel (mamba_ssm `d_state`, HF `state_size`).", validator=at_least(1)
    )
    chunk_size: int = field(
        256,
        doc="Tokens per chunk of the SSD scan: the work is quadratic within a chunk, a state is passed between chunks. "
        "Changes the rounding, not the result.",
        validator=at_least(1),
    )
    convolution: ConvolutionConfig = field(factory=ConvolutionConfig, doc="The causal convolution over x‖B‖C.")
    recompute_convolution: bool = field(
        True,
        doc="Training on the GPU kernels (mamba_ssm's SSD kernels): keep the convolution's input (in_proj's output, "
        "kept anyway) instead of its output for the backward pass, which runs the convolution again "
        "(`blockzoo_ssm.convolved_ssd_scan`; mamba_ssm's fused layer does the same). Saves a [tokens, x+B+C] "
        "tensor per layer (the Mamba 2 LM 1.3B at 16384 tokens: 6.2 GiB, its step no slower on an H200); elsewhere "
        "no effect. False: the convolution's output is kept.",
    )
    z: LinearConfig = field(factory=LinearConfig, doc=_in_proj_doc("the gate z of the output norm"))
    x: LinearConfig = field(factory=LinearConfig, doc=_in_proj_doc("the scan's input x"))
    b: LinearConfig = field(factory=LinearConfig, doc=_in_proj_doc("B, the state's input map, per group"))
    c: LinearConfig = field(factory=LinearConfig, doc=_in_proj_doc("C, the state's output map, per group"))
    dt: LinearConfig = field(factory=LinearConfig, doc=_in_proj_doc("the time step dt, per head, before dt_bias"))
    out_proj: LinearConfig = field(
        factory=LinearConfig, doc="The output projection, inner → hidden. Its bias defaults to `add_linear_biases`."
    )
    add_linear_biases: bool = field(False, doc="Default of in_proj's and out_proj's `bias.enabled` (mamba_ssm `bias`).")
    dt_bias: ParameterConfig = field(
        factory=ParameterConfig,
        doc="Added to dt before the softplus, one per head. Default initialization `dt_bias` (softplus⁻¹ of a "
        "log-uniform time step in [min, max], floored: mamba_ssm's), no weight decay.",
    )
    dt_limit: tuple[float, float] = field(
        (0.0, math.inf),
        doc="[min, max]: softplus(dt + dt_bias) is clamped to it (mamba_ssm `dt_limit`, HF `time_step_limit`); max "
        "may be `.inf` (no upper clamp).",
        infinite=True,
    )
    a_log: ParameterConfig = field(
        factory=ParameterConfig,
        doc="A = -exp(A_log), one per head. Default initialization `a_log_range` (log of uniform [1, 16], mamba_ssm's "
        "`A_init_range`), no weight decay.",
    )
    d: ParameterConfig = field(factory=ParameterConfig, doc="The skip y += D · x (ones by default, no weight decay).")
    d_per_channel: bool = field(
        False, doc="D has one value per channel of each head (mamba_ssm `D_has_hdim`) instead of one per head."
    )
    normalization: GatedNormalizationConfig = field(
        factory=GatedNormalizationConfig, doc="The gated RMSNorm of the scan's output (or the gate alone)."
    )
    in_proj_multipliers: dict[str, float] = field(
        factory=dict,
        doc="Scales in_proj's output per component (z, x, b, c, dt; 1 if absent): Falcon-H1's ssm_multipliers "
        "(its mup_vector).",
    )
    lr_scale: float | None = field(
        None, doc="Multiplies the parent's learning-rate scale; 0 freezes.", validator=at_least(0)
    )

    def __attrs_post_init__(self) -> None:
        check_head_groups(self.heads, self.groups)
        for name in self.in_proj_multipliers:
            check(
                name in IN_PROJ_COMPONENTS,
                f"in_proj_multipliers.{name}",
                f"no in_proj component {name!r} (they are {', '.join(IN_PROJ_COMPONENTS)})",
            )
        low, high = self.dt_limit
        check(0 <= low < high, "dt_limit", f"must be [min, max] with 0 <= min < max, got [{low}, {high}]")
        check_fused_biases({name: getattr(self, name) for name in IN_PROJ_COMPONENTS}, self.add_linear_biases)

    def check_tensor_parallel(self, tensor_parallel: int) -> None:
        check_groups_tensor_parallel(self.groups, tensor_parallel)
        # Without a norm there are no statistics to split.
        if tensor_parallel > 1 and self.normalization.enabled and not self.normalization.per_group:
            raise ConfigFieldError(
                "normalization.per_group",
                f"false normalizes over the whole inner dimension, which tensor_parallel={tensor_parallel} splits "
                "between ranks; use per_group: true (mamba_ssm's grouping: each rank holds whole groups)",
            )

    @property
    def inner_size(self) -> int:
        return self.heads * self.head_size

    @property
    def norm_group_size(self) -> int:
        """Channels over which the gated norm takes its statistics."""
        return self.inner_size // self.groups if self.normalization.per_group else self.inner_size

    def has_bias(self, linear: LinearConfig) -> bool:
        return linear.has_bias(self.add_linear_biases)
