"""Config of the multi-head latent attention mixer (DeepSeek-V2/V3's MLA). Torch-free.

The rotary embedding is the attention plugin's polymorphic `rotary` kind (its types and frequencies).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from blockzoo.api import (
    GENERATION_CACHE,
    SEQUENCE_DATA_PARALLEL,
    SEQUENCE_TENSOR_PARALLEL,
    TENSOR_PARALLEL,
    ConfigFieldError,
    LinearConfig,
    MixerConfig,
    NormalizationConfig,
    at_least,
    check,
    configclass,
    field,
    greater_than,
    structure,
)
from blockzoo_attention.config import DefaultRotaryConfig, NoRotaryConfig, PartialRotaryConfig, RotaryConfig


def _default_norm(path: str):
    return lambda: structure({}, NormalizationConfig, root=path)


def _linear_doc(role: str) -> str:
    return f"{role} Its bias defaults to `add_linear_biases`."


@configclass
class MLAConfig(MixerConfig):
    """Multi-head latent attention over packed documents (DeepSeek-V2/V3).

    Query: `query` (hidden → heads·(nope + rotary)), or with `query_rank` a low-rank pair `query_down` (hidden →
    query_rank) → `query_norm` → `query_up` (→ heads·(nope + rotary)). Key and value: `key_value_down` (hidden →
    key_value_rank + rotary) gives the compressed latent and one rotary key part shared by every head; the latent
    goes through `key_value_norm` and `key_value_up` (→ heads·(nope + value)). Each head's key is [its nope part ‖ the
    shared rotary part]; rotary turns only the rotary parts of queries and keys. `dense` maps heads·value back.

    Tensor-parallel: the heads are split (`query` / `query_up` / `key_value_up` column-parallel, `dense`
    row-parallel); the down projections and their norms are replicated. Generation keeps a latent cache (the
    normalized latent and the rotated shared key part per token), and decodes one token per sequence in the absorbed
    form (`key_value_up`'s key rows folded into the query, its value rows into the output).

    Sequence-data parallel and micro-sequences: the compressed tokens (latent ‖ rotary key part) are gathered over
    the group and carried between micro-sequences; each rank expands them to its keys and values.
    """

    capabilities: ClassVar[frozenset[str]] = frozenset(
        {TENSOR_PARALLEL, SEQUENCE_TENSOR_PARALLEL, SEQUENCE_DATA_PARALLEL, GENERATION_CACHE}
    )

    heads: int = field(16, doc="Attention heads.", validator=at_least(1))
    query_rank: int | None = field(
        None,
        doc="Rank of the low-rank query (DeepSeek's q_lora_rank): query_down → query_norm → query_up. None: one "
        "`query` projection.",
        validator=at_least(1),
    )
    key_value_rank: int = field(
        512, doc="Size of the compressed key-value latent (DeepSeek's kv_lora_rank).", validator=at_least(1)
    )
    nope_head_size: int = field(
        128, doc="Channels of each query/key head without position embedding (qk_nope_head_dim).", validator=at_least(1)
    )
    rotary_head_size: int = field(
        64,
        doc="Channels of each query head, and of the key part shared by every head, that rotary turns "
        "(qk_rope_head_dim).",
        validator=at_least(1),
    )
    value_head_size: int = field(128, doc="Size of each value head (v_head_dim).", validator=at_least(1))
    query: LinearConfig = field(
        factory=LinearConfig, doc=_linear_doc("The query projection, without `query_rank` (q_proj).")
    )
    query_down: LinearConfig = field(
        factory=LinearConfig, doc=_linear_doc("The query compression, with `query_rank` (q_a_proj).")
    )
    query_norm: NormalizationConfig = field(
        factory=_default_norm("query_norm"), doc="Normalizes the compressed query, with `query_rank` (q_a_layernorm)."
    )
    query_up: LinearConfig = field(
        factory=LinearConfig, doc=_linear_doc("The query decompression, with `query_rank` (q_b_proj).")
    )
    key_value_down: LinearConfig = field(
        factory=LinearConfig,
        doc=_linear_doc("The key-value compression and shared rotary key part (kv_a_proj_with_mqa)."),
    )
    key_value_norm: NormalizationConfig = field(
        factory=_default_norm("key_value_norm"), doc="Normalizes the key-value latent (kv_a_layernorm)."
    )
    key_value_up: LinearConfig = field(
        factory=LinearConfig,
        doc=_linear_doc("The key-value decompression to each head's nope key and value (kv_b_proj)."),
    )
    dense: LinearConfig = field(factory=LinearConfig, doc=_linear_doc("The output projection (o_proj)."))
    add_linear_biases: bool = field(False, doc="Default of each projection's `bias.enabled`.")
    rotary: RotaryConfig = field(
        factory=DefaultRotaryConfig, doc="Rotary position embedding of the rotary parts (`none` for NoPE)."
    )
    interleaved_rotary: bool = field(
        False,
        doc="Rotary turns adjacent channels (2i, 2i+1) of the rotary parts as pairs (DeepSeek's checkpoints, "
        "transformers' rope_interleave) instead of (i, i + rotary_head_size/2).",
    )
    softmax_scale: float | None = field(
        None,
        doc="Multiplies the query·key logits. None: (nope_head_size + rotary_head_size)**-0.5 (DeepSeek with YaRN "
        "also multiplies by mscale²: the converter computes it).",
        validator=greater_than(0),
    )
    absorbed_decoding: bool = field(
        True,
        doc="Decode one token per sequence in the absorbed form, attending over the latent cache directly; false: "
        "expand every cached latent to keys and values each step. The same attention either way.",
    )
    implementation: Literal["auto", "torch", "varlen", "batched", "flex"] = field(
        "auto",
        doc="Attention kernel (the attention plugin's, see its `implementation`); the flash kernels get the value "
        "heads padded to the query/key head size when they differ.",
    )
    lr_scale: float | None = field(
        None, doc="Multiplies the parent's learning-rate scale; 0 freezes.", validator=at_least(0)
    )

    def __attrs_post_init__(self) -> None:
        check(
            isinstance(self.rotary, NoRotaryConfig) or self.rotary_head_size % 2 == 0,
            "rotary_head_size",
            f"rotary embeddings rotate pairs of dims: rotary_head_size must be even, got {self.rotary_head_size}",
        )
        check(
            not isinstance(self.rotary, PartialRotaryConfig),
            "rotary",
            "type `partial` does not apply: only the rotary_head_size channels of each head rotate already",
        )

    def check_tensor_parallel(self, tensor_parallel: int) -> None:
        if self.heads % tensor_parallel:
            raise ConfigFieldError("heads", f"tensor_parallel={tensor_parallel} must divide heads ({self.heads})")

    @property
    def query_key_head_size(self) -> int:
        """Channels of each query and key head: nope + rotary."""
        return self.nope_head_size + self.rotary_head_size

    @property
    def resolved_softmax_scale(self) -> float:
        return self.query_key_head_size**-0.5 if self.softmax_scale is None else self.softmax_scale

    def has_bias(self, linear: LinearConfig) -> bool:
        return linear.has_bias(self.add_linear_biases)
