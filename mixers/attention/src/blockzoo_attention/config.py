"""Configs of the attention mixer and of its rotary position embeddings. Torch-free.

Rotary embeddings are their own polymorphic kind (`rotary`, default type `default`), so a plugin can
add a type: it registers a config class deriving from `RotaryConfig` with `register_components`, and an
implementation `fn(config, head_size) -> (inverse_frequencies, attention_factor)` (see `rotary.py`).
"""

from __future__ import annotations

import math
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
    PolymorphicConfig,
    at_least,
    check,
    check_fused_biases,
    configclass,
    field,
    greater_than,
)

# ---------------------------------------------------------------------------------------------------------------------
# Rotary position embeddings (rotate-half layout: dims i and i + head_size/2 form a pair)


@configclass
class RotaryConfig(PolymorphicConfig):
    """How positions enter the queries and keys. Kind `rotary`, default type `default`."""

    kind: ClassVar[str] = "rotary"
    default_type: ClassVar[str] = "default"


@configclass
class NoRotaryConfig(RotaryConfig):
    """No position embedding (NoPE)."""


@configclass
class DefaultRotaryConfig(RotaryConfig):
    """RoPE: pair i rotates by position · theta^(-2i/head_size)."""

    theta: float = field(10000.0, doc="Base of the frequencies.", validator=greater_than(0))


@configclass
class Llama3RotaryConfig(DefaultRotaryConfig):
    """Llama 3.1's frequency scaling: long wavelengths divided by `scale_factor`, short ones kept, smooth between."""

    scale_factor: float = field(8.0, doc="Long wavelengths are stretched by this factor.", validator=greater_than(0))
    low_frequency_factor: float = field(
        1.0, doc="Wavelengths above original_context_length / this are fully scaled.", validator=greater_than(0)
    )
    high_frequency_factor: float = field(
        4.0, doc="Wavelengths below original_context_length / this are kept.", validator=greater_than(0)
    )
    original_context_length: int = field(8192, doc="Context length of the unscaled model.", validator=at_least(1))

    def __attrs_post_init__(self) -> None:
        check(
            self.high_frequency_factor > self.low_frequency_factor,
            "high_frequency_factor",
            f"must be > low_frequency_factor ({self.low_frequency_factor}), got {self.high_frequency_factor}",
        )


@configclass
class YarnRotaryConfig(DefaultRotaryConfig):
    """YaRN: frequencies interpolated by `scale_factor` outside a ramp set by beta_fast/beta_slow, logits rescaled."""

    scale_factor: float = field(8.0, doc="Context extension factor.", validator=greater_than(0))
    attention_factor: float | None = field(
        None,
        doc="Scales the rotary tables (so the logits by its square). None: 0.1·ln(scale_factor) + 1.",
        validator=greater_than(0),
    )
    beta_fast: float = field(
        32.0, doc="Rotations over the original context below which pairs are interpolated.", validator=greater_than(0)
    )
    beta_slow: float = field(
        1.0, doc="Rotations over the original context above which pairs are kept.", validator=greater_than(0)
    )
    original_context_length: int = field(8192, doc="Context length of the unscaled model.", validator=at_least(1))

    def __attrs_post_init__(self) -> None:
        check(
            self.beta_fast > self.beta_slow,
            "beta_fast",
            f"must be > beta_slow ({self.beta_slow}), got {self.beta_fast}",
        )

    @property
    def resolved_attention_factor(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor
        return 0.1 * math.log(self.scale_factor) + 1.0 if self.scale_factor > 1 else 1.0


@configclass
class PartialRotaryConfig(DefaultRotaryConfig):
    """RoPE on part of each head (GPT-NeoX, Bamba): of rotary_size = int(fraction · head_size) channels, as if the
    head had that size; the other channels pass through. In this layout the rotating pairs are (i, i + head_size/2)
    for i < rotary_size/2; transformers' `partial_rotary_factor` rotates the first rotary_size channels instead,
    the same attention once each head's query and key channels are permuted (the converters do)."""

    fraction: float = field(
        0.5,
        doc="Share of each head's channels that rotate (transformers' `partial_rotary_factor`); fraction · head_size "
        "must round down to an even number.",
        validator=greater_than(0),
    )

    def __attrs_post_init__(self) -> None:
        check(self.fraction <= 1, "fraction", f"must be in (0, 1], got {self.fraction}")

    def rotary_size(self, head_size: int) -> int:
        """The channels of a head that rotate (transformers' rotary dim; the attention config checks it is even)."""
        return int(head_size * self.fraction)


# ---------------------------------------------------------------------------------------------------------------------
# Attention


def _linear_doc(role: str) -> str:
    return f"The {role} projection. Its bias defaults to `add_linear_biases`."


@configclass
class AttentionConfig(MixerConfig):
    """Multi-head self-attention over packed documents: MHA, GQA (`head_groups` < `heads`) or MQA (`head_groups` 1).

    Query heads are laid out group-major: head h uses key/value group h // (heads / head_groups).
    Tensor-parallel: the head groups are split when tensor_parallel divides head_groups; otherwise the heads
    of each group are split and key/value are replicated (MQA).
    """

    capabilities: ClassVar[frozenset[str]] = frozenset(
        {TENSOR_PARALLEL, SEQUENCE_TENSOR_PARALLEL, SEQUENCE_DATA_PARALLEL, GENERATION_CACHE}
    )

    heads: int = field(8, doc="Query heads.", validator=at_least(1))
    head_groups: int | None = field(
        None,
        doc="Key/value heads, each shared by heads / head_groups query heads. None: heads (MHA).",
        validator=at_least(1),
    )
    head_size: int = field(64, doc="Size of each head (independent of the hidden size).", validator=at_least(1))
    query: LinearConfig = field(factory=LinearConfig, doc=_linear_doc("query"))
    key: LinearConfig = field(factory=LinearConfig, doc=_linear_doc("key") + " Key and value share one weight.")
    value: LinearConfig = field(factory=LinearConfig, doc=_linear_doc("value") + " Its bias must match the key's.")
    dense: LinearConfig = field(factory=LinearConfig, doc=_linear_doc("output"))
    add_linear_biases: bool = field(False, doc="Default of each projection's `bias.enabled`.")
    rotary: RotaryConfig = field(factory=DefaultRotaryConfig, doc="Rotary position embedding (`none` for NoPE).")
    causal: bool = field(True, doc="Each token sees only the tokens before it (and itself).")
    window_size: int | None = field(
        None,
        doc="Sliding window: each token sees this many tokens, itself included. None: no window.",
        validator=at_least(1),
    )
    softmax_scale: float | None = field(
        None, doc="Multiplies the query·key logits. None: head_size**-0.5.", validator=greater_than(0)
    )
    key_multiplier: float = field(
        1.0, doc="Scales the keys as projected, before the key norm and rotary (Falcon-H1's key_multiplier)."
    )
    query_norm: NormalizationConfig | None = field(None, doc="Normalizes each query head (before rotary).")
    key_norm: NormalizationConfig | None = field(None, doc="Normalizes each key head (before rotary).")
    output_gate: LinearConfig | None = field(
        None,
        doc="An output gate: attention's output times sigmoid(gate(hidden)), per channel of each head, before `dense` "
        "(Qwen3-Next's gated attention). `{}` enables it with default settings; its bias defaults to "
        "`add_linear_biases`. None: no gate.",
    )
    implementation: Literal["auto", "torch", "varlen", "batched", "flex"] = field(
        "auto",
        doc="Attention kernel. torch: SDPA with a block-diagonal mask (the CPU reference); varlen: torch's "
        "flash varlen_attn (CUDA, bf16/fp16); batched: varlen, but when every document has one length (and no "
        "window) SDPA over [documents, heads, length, head_size]; flex: FlexAttention with a document mask "
        "(compiled on CUDA). auto: on CUDA batched where it can run (bf16/fp16), else torch; torch on the CPU.",
    )
    lr_scale: float | None = field(
        None, doc="Multiplies the parent's learning-rate scale; 0 freezes.", validator=at_least(0)
    )

    def __attrs_post_init__(self) -> None:
        groups = self.resolved_head_groups
        check(groups <= self.heads, "head_groups", f"must be <= heads ({self.heads}), got {groups}")
        check(self.heads % groups == 0, "head_groups", f"must divide heads ({self.heads}), got {groups}")
        check(
            self.window_size is None or self.causal,
            "window_size",
            "a sliding window needs causal attention (set causal: true or window_size: null)",
        )
        check(
            isinstance(self.rotary, NoRotaryConfig) or self.head_size % 2 == 0,
            "head_size",
            f"rotary embeddings rotate pairs of dims: head_size must be even, got {self.head_size}",
        )
        if isinstance(self.rotary, PartialRotaryConfig):
            turning = int(self.rotary.fraction * self.head_size)
            check(
                turning > 0 and turning % 2 == 0,
                "rotary.fraction",
                f"rotates int(fraction · head_size) = {turning} channels of each head: must be a positive even number",
            )
        check_fused_biases({"key": self.key, "value": self.value}, self.add_linear_biases, weight="key_value")

    def check_tensor_parallel(self, tensor_parallel: int) -> None:
        # Head groups are split when the ranks divide them; otherwise the heads of each group are.
        groups = self.resolved_head_groups
        if groups % tensor_parallel and (self.heads // groups) % tensor_parallel:
            raise ConfigFieldError(
                "head_groups",
                f"tensor_parallel={tensor_parallel} must divide head_groups ({groups}) or the heads per group "
                f"({self.heads // groups})",
            )

    def check_sequence_data_parallel(self) -> None:
        # Over slices a token sees the slices before its own, never the ones after.
        check(
            self.causal,
            "causal",
            "attention over slices of sequences (sequence_data_parallel, micro_sequence_length) must be causal",
        )

    @property
    def resolved_head_groups(self) -> int:
        return self.heads if self.head_groups is None else self.head_groups

    @property
    def resolved_softmax_scale(self) -> float:
        return self.head_size**-0.5 if self.softmax_scale is None else self.softmax_scale

    def has_bias(self, linear: LinearConfig) -> bool:
        return linear.has_bias(self.add_linear_biases)
