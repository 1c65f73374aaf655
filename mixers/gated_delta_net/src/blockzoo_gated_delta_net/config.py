"""Config of the Gated DeltaNet mixer (`type: gated_delta_net`). Torch-free, like every plugin's config module.

Names of the references each field matches: Hugging Face's `Qwen3NextGatedDeltaNet` (`linear_*` config keys) and
flash-linear-attention's `fla.layers.GatedDeltaNet`.
"""

from __future__ import annotations

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
from blockzoo_ssm import ConvolutionConfig

# The components of the fused input projection, in this order: q‖k‖v is the convolution's input.
IN_PROJ_COMPONENTS = ("q", "k", "v", "z", "b", "a")


@configclass
class OutputNormalizationConfig(Config):
    """RMSNorm of each value head's output, times a weight shared by the heads, then gated: RMSNorm(o) · weight ·
    silu(z) (Qwen3-Next's `Qwen3NextRMSNormGated`, fla's `FusedRMSNormGated`: the norm before the gate)."""

    epsilon: float = field(
        1.0e-6, doc="Added to the mean square (Qwen3-Next `rms_norm_eps`; fla `norm_eps` 1e-5).", validator=at_least(0)
    )
    weight: ParameterConfig = field(
        factory=ParameterConfig, doc="The scale, one per channel of a value head (ones by default, no weight decay)."
    )
    lr_scale: float | None = field(
        None, doc="Multiplies the mixer's learning-rate scale; 0 freezes.", validator=at_least(0)
    )


def _in_proj_doc(role: str) -> str:
    return f"The rows of the fused input projection `in_proj` computing {role}. Bias default: `add_linear_biases`."


@configclass
class GatedDeltaNetConfig(MixerConfig):
    """Gated DeltaNet: in_proj → [q, k, v, z, b, a]; causal conv + silu over q‖k‖v; q, k L2-normalised, q scaled by
    key_head_size^-0.5; per value head the gated delta rule S_t = α_t S_{t-1} (I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ,
    o_t = S_t q_t with β = sigmoid(b), log α = -exp(A_log) · softplus(a + dt_bias); RMSNorm(o) · w · silu(z); out_proj.

    Value head h reads key head h // (value_heads / key_heads) (grouped values, Qwen3-Next's layout).
    Tensor-parallel: key heads are split with their value heads (tensor_parallel must divide key_heads), so are
    the in_proj components, the convolution's channels, dt_bias and A_log; out_proj is row-parallel.
    """

    capabilities: ClassVar[frozenset[str]] = frozenset(
        {TENSOR_PARALLEL, SEQUENCE_TENSOR_PARALLEL, SEQUENCE_DATA_PARALLEL, GENERATION_CACHE}
    )

    key_heads: int = field(
        16, doc="Query/key heads (Qwen3-Next `linear_num_key_heads`, fla `num_heads`).", validator=at_least(1)
    )
    value_heads: int = field(
        32,
        doc="Value heads, each with its own state, decay and β (Qwen3-Next `linear_num_value_heads`, fla "
        "`num_v_heads`). A multiple of key_heads.",
        validator=at_least(1),
    )
    key_head_size: int = field(
        128, doc="Channels of each query/key head (Qwen3-Next `linear_key_head_dim`).", validator=at_least(1)
    )
    value_head_size: int = field(
        128, doc="Channels of each value head (Qwen3-Next `linear_value_head_dim`).", validator=at_least(1)
    )
    chunk_size: int = field(
        64,
        doc="Tokens per chunk of the torch path's chunked (WY) form: the work is quadratic within a chunk, a state is "
        "passed between chunks. Changes the rounding, not the result (flash-linear-attention's kernel uses 64).",
        validator=at_least(1),
    )
    convolution: ConvolutionConfig = field(
        factory=ConvolutionConfig,
        doc="The causal convolution over q‖k‖v. Its bias is off unless `bias.enabled: true` (Qwen3-Next and fla "
        "have none).",
    )
    q: LinearConfig = field(factory=LinearConfig, doc=_in_proj_doc("the queries"))
    k: LinearConfig = field(factory=LinearConfig, doc=_in_proj_doc("the keys"))
    v: LinearConfig = field(factory=LinearConfig, doc=_in_proj_doc("the values"))
    z: LinearConfig = field(factory=LinearConfig, doc=_in_proj_doc("the output gate z, per value channel"))
    b: LinearConfig = field(factory=LinearConfig, doc=_in_proj_doc("b, β = sigmoid(b), per value head"))
    a: LinearConfig = field(factory=LinearConfig, doc=_in_proj_doc("a, the decay's input, per value head"))
    out_proj: LinearConfig = field(
        factory=LinearConfig, doc="The output projection, values → hidden. Its bias defaults to `add_linear_biases`."
    )
    add_linear_biases: bool = field(False, doc="Default of in_proj's and out_proj's `bias.enabled`.")
    dt_bias: ParameterConfig = field(
        factory=ParameterConfig,
        doc="Added to a before the softplus, one per value head. Default initialization `dt_bias` (softplus⁻¹ of a "
        "log-uniform time step in [min, max]: fla's and mamba_ssm's), no weight decay.",
    )
    a_log: ParameterConfig = field(
        factory=ParameterConfig,
        doc="log α = -exp(A_log) · softplus(a + dt_bias), one per value head. Default initialization `a_log_range` "
        "(log of uniform [1, 16]), no weight decay.",
    )
    normalization: OutputNormalizationConfig = field(
        factory=OutputNormalizationConfig, doc="The gated RMSNorm of each value head's output."
    )
    lr_scale: float | None = field(
        None, doc="Multiplies the parent's learning-rate scale; 0 freezes.", validator=at_least(0)
    )

    def __attrs_post_init__(self) -> None:
        check(
            self.value_heads % self.key_heads == 0,
            "value_heads",
            f"must be a multiple of key_heads ({self.key_heads}), got {self.value_heads}",
        )
        check_fused_biases({name: getattr(self, name) for name in IN_PROJ_COMPONENTS}, self.add_linear_biases)

    def check_tensor_parallel(self, tensor_parallel: int) -> None:
        if self.key_heads % tensor_parallel:
            raise ConfigFieldError(
                "key_heads",
                f"tensor_parallel={tensor_parallel} must divide key_heads ({self.key_heads}): key heads are split "
                "between ranks with the value heads that read them",
            )

    @property
    def key_size(self) -> int:
        return self.key_heads * self.key_head_size

    @property
    def value_size(self) -> int:
        return self.value_heads * self.value_head_size

    @property
    def has_convolution_bias(self) -> bool:
        """Off unless enabled explicitly (`ConvolutionConfig.has_bias` treats unset as on)."""
        return self.convolution.bias.enabled is True

    def has_bias(self, linear: LinearConfig) -> bool:
        return linear.has_bias(self.add_linear_biases)
