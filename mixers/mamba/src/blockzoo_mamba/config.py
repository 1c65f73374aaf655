"""Config of the Mamba 1 mixer (`type: mamba`). Torch-free, like every plugin's config module.

Two layouts of the same selective-scan mixer (see README.md for both, with weight shapes):
- standard (`xb_size: null`): mamba_ssm's `Mamba` (`modules/mamba_simple.py`), Hugging Face's `MambaMixer`, and
  Jamba's mixer with `dt_norm`, `b_norm`, `c_norm`. in_proj → [x, z]; x_proj reads the convolved x → [dt, B, C].
- grouped (`xb_size` set): the "m2" layers of ServiceNow's Apriel hybrid SSM ("Mamba in the Llama"). in_proj →
  [z, x, B, C] with x and B of `xb_size` channels (heads of `state_size` channels, each shared by several output
  heads), C of `inner_size`; dt comes from the hidden states through dt_in_proj.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

from blockzoo.api import (
    GENERATION_CACHE,
    SEQUENCE_DATA_PARALLEL,
    SEQUENCE_TENSOR_PARALLEL,
    TENSOR_PARALLEL,
    BiasConfig,
    ConfigFieldError,
    LinearConfig,
    MixerConfig,
    NormalizationConfig,
    ParameterConfig,
    at_least,
    check,
    check_fused_biases,
    configclass,
    field,
    greater_than,
)
from blockzoo_ssm import ConvolutionConfig

# The components of the fused input projection `in_proj`, in the row order of the checkpoints each layout matches.
STANDARD_IN_PROJ = ("x", "z")  # mamba_ssm / HF: `x, z = in_proj(hidden).chunk(2)`
GROUPED_IN_PROJ = ("z", "x", "b", "c")  # Apriel: `z, x, B, C = in_proj(hidden).split([inner, xb, xb, inner])`
DEFAULT_EXPAND = 2


def _in_proj_doc(role: str, layout: str = "") -> str:
    return f"The rows of the fused input projection `in_proj` that compute {role}{layout}. Bias: `add_linear_biases`."


_GROUPED_ONLY = " (grouped layout only)"


@configclass
class MambaConfig(MixerConfig):
    """Mamba 1: in_proj → x, z; causal conv + silu on x; dt, B, C from x (x_proj) or, in the grouped layout, from
    the hidden states and in_proj; optional RMS norms on dt, B, C (Jamba); Δ = softplus(dt_proj(dt) + dt_bias); the
    selective scan with A = -exp(A_log) [inner, state]; + D·x; y · silu(z); out_proj.

    Tensor-parallel: the inner channels are split (in the grouped layout, whole heads of `state_size` channels:
    tensor_parallel must divide the x/B heads and the C heads); out_proj and x_proj are row-parallel.
    """

    capabilities: ClassVar[frozenset[str]] = frozenset(
        {TENSOR_PARALLEL, SEQUENCE_TENSOR_PARALLEL, SEQUENCE_DATA_PARALLEL, GENERATION_CACHE}
    )

    state_size: int = field(
        16, doc="State size N of each channel (mamba_ssm `d_state`, HF `state_size`).", validator=at_least(1)
    )
    inner_size: int | None = field(
        None,
        doc="Channels of the scan (mamba_ssm `d_inner`, HF `intermediate_size`). None: expand × the hidden size.",
        validator=at_least(1),
    )
    expand: int | None = field(
        None,
        doc=f"inner_size = expand × hidden size when inner_size is not given. None: {DEFAULT_EXPAND} (mamba_ssm).",
        validator=at_least(1),
    )
    xb_size: int | None = field(
        None,
        doc="Selects the grouped layout (Apriel `d_xb`): x and B have this many channels, in heads of state_size "
        "channels, each x/B head shared by inner_size / xb_size consecutive C heads. None: the standard layout.",
        validator=at_least(1),
    )
    repeat_xb_before_convolution: bool = field(
        True,
        doc="Grouped layout: repeat the x heads to inner_size channels before the convolution (which then has "
        "inner_size channels), or after it (xb_size channels). Apriel `repeat_kv_before_conv`.",
    )
    dt_rank: int | None = field(
        None,
        doc="Rank of the time-step projection (mamba_ssm `dt_rank`, HF `time_step_rank`). None: ceil(hidden / 16).",
        validator=at_least(1),
    )
    convolution: ConvolutionConfig = field(factory=ConvolutionConfig, doc="The causal convolution over x.")
    x: LinearConfig = field(factory=LinearConfig, doc=_in_proj_doc("x, the scan's input"))
    z: LinearConfig = field(factory=LinearConfig, doc=_in_proj_doc("z, the output gate"))
    b: LinearConfig = field(factory=LinearConfig, doc=_in_proj_doc("B, the state's input map", _GROUPED_ONLY))
    c: LinearConfig = field(factory=LinearConfig, doc=_in_proj_doc("C, the state's output map", _GROUPED_ONLY))
    x_proj: LinearConfig = field(
        factory=LinearConfig,
        doc="Standard layout: convolved x → [dt (dt_rank), B (state), C (state)]. No bias unless enabled here "
        "(mamba_ssm has none).",
    )
    dt_in_proj: LinearConfig = field(
        factory=LinearConfig,
        doc="Grouped layout: hidden → dt (dt_rank). Its bias defaults to `add_linear_biases` (Apriel `bias`).",
    )
    dt_proj: LinearConfig = field(
        factory=LinearConfig,
        doc="dt (dt_rank) → one time step per channel. Its bias is `dt_bias`. Weight initialization by default from "
        "dt_init and dt_scale.",
    )
    dt_init: Literal["random", "constant"] = field(
        "random",
        doc="Default initialization of dt_proj's weight: uniform(±s) (random) or s (constant), s = dt_rank^-0.5 × "
        "dt_scale (mamba_ssm `dt_init`, HF `time_step_init_scheme`).",
    )
    dt_scale: float = field(
        1.0, doc="See dt_init (mamba_ssm `dt_scale`, HF `time_step_scale`).", validator=greater_than(0)
    )
    dt_bias: BiasConfig = field(
        factory=BiasConfig,
        doc="Added in fp32 to dt_proj's output before the softplus, one per channel (mamba_ssm `dt_proj.bias`, passed "
        "as `delta_bias`). `enabled` None: true (Apriel `dt_proj_bias`). Default initialization `dt_bias` (softplus⁻¹ "
        "of a log-uniform time step in [min, max], floored: mamba_ssm's), no weight decay.",
    )
    a_log: ParameterConfig = field(
        factory=ParameterConfig,
        doc="A = -exp(A_log), [inner, state]. Default initialization `a_log_state` (log 1..N along the state: "
        "mamba_ssm's S4D real), no weight decay.",
    )
    d: ParameterConfig = field(
        factory=ParameterConfig, doc="The skip y += D · x, one per channel (ones by default, no weight decay)."
    )
    out_proj: LinearConfig = field(
        factory=LinearConfig, doc="The output projection, inner → hidden. Its bias defaults to `add_linear_biases`."
    )
    add_linear_biases: bool = field(
        False, doc="Default of the biases of in_proj, out_proj and dt_in_proj (mamba_ssm `bias`, HF `use_bias`)."
    )
    dt_norm: NormalizationConfig | None = field(None, doc="Normalizes dt over dt_rank (Jamba `dt_layernorm`).")
    b_norm: NormalizationConfig | None = field(
        None, doc="Normalizes B over the state, per group (Jamba `b_layernorm`)."
    )
    c_norm: NormalizationConfig | None = field(
        None, doc="Normalizes C over the state, per group (Jamba `c_layernorm`)."
    )
    lr_scale: float | None = field(
        None, doc="Multiplies the parent's learning-rate scale; 0 freezes.", validator=at_least(0)
    )

    def __attrs_post_init__(self) -> None:
        check(
            self.inner_size is None or self.expand is None,
            "expand",
            f"give inner_size ({self.inner_size}) or expand ({self.expand}), not both",
        )
        if self.grouped:
            check(
                self.xb_size % self.state_size == 0,
                "xb_size",
                f"must be a multiple of state_size ({self.state_size}): x and B are heads of state_size channels, "
                f"got {self.xb_size}",
            )
            check(self.x_proj == LinearConfig(), "x_proj", "the grouped layout (xb_size) has no x_proj")
            if self.inner_size is not None:
                self._check_inner_size(self.inner_size)
        else:
            for name in ("b", "c", "dt_in_proj"):
                check(getattr(self, name) == LinearConfig(), name, "only for the grouped layout (set xb_size)")
            check(
                self.repeat_xb_before_convolution,
                "repeat_xb_before_convolution",
                "only for the grouped layout (set xb_size)",
            )
        check(
            self.dt_proj.bias.enabled is not True,
            "dt_proj.bias.enabled",
            "the time step's bias is `dt_bias` (added in fp32 before the softplus); configure it there",
        )
        if self.dt_proj.weight.initialization is not None:
            check(self.dt_init == "random", "dt_init", "dt_proj.weight.initialization is given: it replaces dt_init")
            check(self.dt_scale == 1.0, "dt_scale", "dt_proj.weight.initialization is given: it replaces dt_scale")
        check_fused_biases({name: getattr(self, name) for name in self.in_proj_components}, self.add_linear_biases)

    def _check_inner_size(self, inner_size: int) -> None:
        """Grouped layout: the C heads (inner_size / state_size) are whole and share the x/B heads evenly."""
        check(
            inner_size % self.state_size == 0,
            "inner_size",
            f"the grouped layout splits it into heads of state_size ({self.state_size}) channels, got {inner_size}",
        )
        check(
            (inner_size // self.state_size) % (self.xb_size // self.state_size) == 0,
            "xb_size",
            f"its heads ({self.xb_size // self.state_size}) must divide the heads of inner_size "
            f"({inner_size // self.state_size}), got xb_size {self.xb_size}",
        )

    def check_tensor_parallel(self, tensor_parallel: int) -> None:
        # Grouped: ranks hold whole x/B heads with the C heads they serve (a multiple of them, so split evenly too).
        # Standard without inner_size: the inner size depends on the hidden size; the layer checks it when built.
        if self.grouped:
            if (self.xb_size // self.state_size) % tensor_parallel:
                raise ConfigFieldError(
                    "xb_size",
                    f"tensor_parallel={tensor_parallel} must divide the x/B heads (xb_size / state_size = "
                    f"{self.xb_size // self.state_size}): ranks hold whole heads",
                )
        elif self.inner_size is not None and self.inner_size % tensor_parallel:
            raise ConfigFieldError(
                "inner_size",
                f"tensor_parallel={tensor_parallel} must divide inner_size ({self.inner_size}): its channels are split",
            )

    @property
    def grouped(self) -> bool:
        return self.xb_size is not None

    @property
    def in_proj_components(self) -> tuple[str, ...]:
        return GROUPED_IN_PROJ if self.grouped else STANDARD_IN_PROJ

    def resolved_inner_size(self, hidden_size: int) -> int:
        if self.inner_size is not None:
            return self.inner_size
        return (DEFAULT_EXPAND if self.expand is None else self.expand) * hidden_size

    def resolved_dt_rank(self, hidden_size: int) -> int:
        return math.ceil(hidden_size / 16) if self.dt_rank is None else self.dt_rank

    def check_hidden_size(self, hidden_size: int, tensor_parallel: int) -> None:
        """The checks that need the inner size when it comes from the hidden size (expand); ConfigFieldError."""
        inner_size = self.resolved_inner_size(hidden_size)
        field_name = "inner_size" if self.inner_size is not None else "expand"
        if self.grouped:
            try:
                self._check_inner_size(inner_size)
            except ConfigFieldError as error:
                raise ConfigFieldError(field_name, f"{error.message} (inner size {inner_size})") from None
        else:
            check(
                inner_size % tensor_parallel == 0,
                field_name,
                f"tensor_parallel={tensor_parallel} must divide the inner size ({inner_size})",
            )
        self.check_tensor_parallel(tensor_parallel)

    def has_bias(self, linear: LinearConfig) -> bool:
        return linear.has_bias(self.add_linear_biases)

    @property
    def has_dt_bias(self) -> bool:
        return True if self.dt_bias.enabled is None else self.dt_bias.enabled
