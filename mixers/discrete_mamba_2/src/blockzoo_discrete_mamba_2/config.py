"""Config of the discrete Mamba 2 mixer (`type: discrete_mamba_2`). Torch-free.

Field names follow blockzoo's style; README.md maps each to the reference (goombalab/phi-mamba's
`discrete_mamba2.Mixer`, which Llamba and Apriel's "m2d" layers copy).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from blockzoo.api import (
    GENERATION_CACHE,
    SEQUENCE_DATA_PARALLEL,
    SEQUENCE_TENSOR_PARALLEL,
    TENSOR_PARALLEL,
    LinearConfig,
    MixerConfig,
    ParameterConfig,
    at_least,
    check_fused_biases,
    configclass,
    field,
)
from blockzoo_ssm import ConvolutionConfig, check_groups_tensor_parallel, check_head_groups


def _in_proj_doc(role: str) -> str:
    return (
        f"The rows of the fused input projection `in_proj` that give {role}. Its bias defaults to `add_linear_biases`."
    )


@configclass
class DiscreteMamba2Config(MixerConfig):
    """Discrete Mamba 2 (MOHAWK, Llamba, Apriel "m2d") over packed documents.

    in_proj: hidden → [x (heads·head_size), B (groups·state_size), C (groups·state_size), z (heads·head_size),
    dt (heads)]; x‖B‖C go through the causal convolution and `activation`. Per document, head h and token t,
    with B_t, C_t of group h // (heads / groups):
        s_t = exp(-softplus(dt_t)) · s_{t-1} + x_t ⊗ B_t      (the input is not scaled by the step)
        y_t = s_t · C_t + D_h · x_t
    output = out_proj(y ⊙ silu(z + z_bias)).
    """

    capabilities: ClassVar[frozenset[str]] = frozenset(
        {TENSOR_PARALLEL, SEQUENCE_TENSOR_PARALLEL, SEQUENCE_DATA_PARALLEL, GENERATION_CACHE}
    )
    # The LinearConfig fields of in_proj's components, in its row order (the reference's).
    IN_PROJ_COMPONENTS: ClassVar[tuple[str, ...]] = ("x", "b", "c", "z", "dt")

    heads: int = field(
        32, doc="Value heads (the reference's n_v_heads): each has its own state.", validator=at_least(1)
    )
    groups: int | None = field(
        None,
        doc="B/C groups (the reference's n_qk_heads), each shared by heads / groups heads. None: heads.",
        validator=at_least(1),
    )
    head_size: int = field(
        64,
        doc="Channels of each head; inner size = heads · head_size (the reference's headdim).",
        validator=at_least(1),
    )
    state_size: int = field(64, doc="State size of each head (the reference's d_state).", validator=at_least(1))
    chunk_size: int = field(
        128, doc="Tokens per chunk of the chunked scan: speed and memory only, not the result.", validator=at_least(1)
    )
    convolution: ConvolutionConfig = field(factory=ConvolutionConfig, doc="The causal convolution over x‖B‖C.")
    activation: Literal["identity", "silu"] = field(
        "identity", doc="Applied to the convolution's output (the reference's activation)."
    )
    x: LinearConfig = field(factory=LinearConfig, doc=_in_proj_doc("x"))
    b: LinearConfig = field(factory=LinearConfig, doc=_in_proj_doc("B"))
    c: LinearConfig = field(factory=LinearConfig, doc=_in_proj_doc("C"))
    z: LinearConfig = field(factory=LinearConfig, doc=_in_proj_doc("the gate z"))
    dt: LinearConfig = field(
        factory=LinearConfig, doc=_in_proj_doc("the step before its softplus (the reference's A_log)")
    )
    out_proj: LinearConfig = field(
        factory=LinearConfig, doc="The output projection, inner → hidden. Its bias defaults to `add_linear_biases`."
    )
    add_linear_biases: bool = field(
        False, doc="Default of in_proj's and out_proj's `bias.enabled` (the reference's bias)."
    )
    z_bias: ParameterConfig = field(
        factory=ParameterConfig,
        doc="Added to the gate z [heads·head_size]; exists only when in_proj has no bias. Default zeros, no weight "
        "decay.",
    )
    d: ParameterConfig = field(
        factory=ParameterConfig, doc="The skip D [heads], y += D · x. Default ones, no weight decay."
    )
    lr_scale: float | None = field(
        None, doc="Multiplies the parent's learning-rate scale; 0 freezes.", validator=at_least(0)
    )

    def __attrs_post_init__(self) -> None:
        check_head_groups(self.heads, self.resolved_groups)
        check_fused_biases({name: getattr(self, name) for name in self.IN_PROJ_COMPONENTS}, self.add_linear_biases)

    def check_tensor_parallel(self, tensor_parallel: int) -> None:
        check_groups_tensor_parallel(self.resolved_groups, tensor_parallel)

    @property
    def resolved_groups(self) -> int:
        return self.heads if self.groups is None else self.groups

    @property
    def inner_size(self) -> int:
        return self.heads * self.head_size

    @property
    def in_proj_has_bias(self) -> bool:
        return self.has_bias(self.x)

    def has_bias(self, linear: LinearConfig) -> bool:
        return linear.has_bias(self.add_linear_biases)
