"""Configs of the language model: blocks, block sequences, embeddings, head. Torch-free."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import attrs

from blockzoo.config import (
    Config,
    ConfigFieldError,
    PolymorphicConfig,
    at_least,
    at_most,
    check,
    configclass,
    field,
    merge,
    structure,
)
from blockzoo.layers.config import MixerConfig, MLPConfig, NoMixerConfig, NormalizationConfig, ParameterConfig
from blockzoo.peft.config import PeftConfig

# Layers are Python modules, built one by one (even on the meta device): far more than any model has would take
# hours to build before a size check could refuse them.
MAX_BLOCKS = 10_000


def _default_of(kind_base: type[PolymorphicConfig], path: str):
    """A factory for a polymorphic field's default: the kind's default type with its defaults."""
    return lambda: structure({}, kind_base, root=path)


@configclass
class BlockConfig(PolymorphicConfig):
    """One layer of the block sequence. Kind `block`, default type `decoder`."""

    kind: ClassVar[str] = "block"
    default_type: ClassVar[str] = "decoder"


@configclass
class DecoderBlockConfig(BlockConfig):
    """norm → mixer → residual → norm → MLP → residual. Either part may be `{type: none}`."""

    mixer: MixerConfig = field(factory=_default_of(MixerConfig, "mixer"), doc="Mixes tokens (default: attention).")
    mlp: MLPConfig = field(factory=_default_of(MLPConfig, "mlp"), doc="Transforms each token (default: mlp).")
    normalization: NormalizationConfig = field(
        factory=_default_of(NormalizationConfig, "normalization"), doc="The pre-mixer and pre-MLP normalizations."
    )
    post_mixer_normalization: NormalizationConfig | None = field(None, doc="Normalizes the mixer output (Gemma-style).")
    post_mlp_normalization: NormalizationConfig | None = field(None, doc="Normalizes the MLP output.")
    residual_multiplier: float = field(
        1.0, doc="Scales the mixer's and the MLP's outputs before each is added to the residual stream (Granite)."
    )
    lr_scale: float | None = field(
        None, doc="Multiplies the parent's learning-rate scale; 0 freezes.", validator=at_least(0)
    )


@configclass
class ParallelBlockConfig(BlockConfig):
    """norm → several mixers side by side, each output scaled, summed → residual → norm → MLP → residual (Falcon-H1).

    Every mixer reads the same normalized input (times its input multiplier); the outputs, each times its output
    multiplier, are summed into one residual branch. The MLP part is the decoder block's and may be `{type: none}`."""

    mixers: dict[str, MixerConfig] = field(
        factory=dict, doc="The mixers, by name (their modules are `mixers.<name>`); at least one, none of type none."
    )
    input_multipliers: dict[str, float] = field(
        factory=dict,
        doc="Scales the normalized input of the named mixers (Falcon-H1's attention and SSM in); 1 if absent.",
    )
    output_multipliers: dict[str, float] = field(
        factory=dict,
        doc="Scales the output of the named mixers before the sum (Falcon-H1's attention and SSM out); 1 if absent.",
    )
    mlp: MLPConfig = field(factory=_default_of(MLPConfig, "mlp"), doc="Transforms each token (default: mlp).")
    normalization: NormalizationConfig = field(
        factory=_default_of(NormalizationConfig, "normalization"), doc="The pre-mixers and pre-MLP normalizations."
    )
    residual_multiplier: float = field(
        1.0, doc="Scales the mixers' sum and the MLP's output before each is added to the residual stream."
    )
    lr_scale: float | None = field(
        None, doc="Multiplies the parent's learning-rate scale; 0 freezes.", validator=at_least(0)
    )

    def __attrs_post_init__(self) -> None:
        check(bool(self.mixers), "mixers", "must name at least one mixer")
        for name, mixer in self.mixers.items():
            check(
                not isinstance(mixer, NoMixerConfig),
                f"mixers.{name}",
                "a parallel block's mixers are real mixers (remove this one; a block of no mixer is a `decoder` with "
                "mixer {type: none})",
            )
        for field_name in ("input_multipliers", "output_multipliers"):
            for name in getattr(self, field_name):
                check(
                    name in self.mixers,
                    f"{field_name}.{name}",
                    f"no mixer named {name!r} in `mixers` (defined: {', '.join(self.mixers)})",
                )


@configclass
class BlockSequenceConfig(PolymorphicConfig):
    """The stack of blocks. Kind `block_sequence`, default type `fixed`."""

    kind: ClassVar[str] = "block_sequence"
    default_type: ClassVar[str] = "fixed"

    def expanded_blocks(self) -> list[tuple[str, BlockConfig]]:
        """(name, config) of every layer in order."""
        raise NotImplementedError


@configclass
class FixedBlockSequenceConfig(BlockSequenceConfig):
    """One block configuration repeated `num_blocks` times."""

    block: BlockConfig = field(factory=_default_of(BlockConfig, "block"), doc="The block, repeated.")
    num_blocks: int = field(
        12, doc=f"Number of layers, at most {MAX_BLOCKS}.", validator=[at_least(1), at_most(MAX_BLOCKS)]
    )

    def expanded_blocks(self) -> list[tuple[str, BlockConfig]]:
        return [("block", self.block)] * self.num_blocks


@configclass
class PatternBlockSequenceConfig(BlockSequenceConfig):
    """Named blocks laid out by a pattern, repeated to fill `num_blocks` (hybrid models)."""

    blocks: dict[str, BlockConfig] = field(factory=dict, doc="The named blocks.")
    pattern: list[str] = field(factory=list, doc="Block names in layer order; repeats to fill num_blocks.")
    num_blocks: int | None = field(
        None,
        doc=f"Number of layers, at most {MAX_BLOCKS}; None: the pattern's length.",
        validator=[at_least(1), at_most(MAX_BLOCKS)],
    )

    def __attrs_post_init__(self) -> None:
        check(bool(self.pattern), "pattern", "must name at least one block")
        available = ", ".join(self.blocks) or "none"
        for index, name in enumerate(self.pattern):
            check(
                name in self.blocks, f"pattern.{index}", f"no block named {name!r} in `blocks` (defined: {available})"
            )
        used = set(self.pattern[: self.num_blocks] if self.num_blocks else self.pattern)
        for name in self.blocks:
            if name not in used:
                raise ConfigFieldError(f"blocks.{name}", "this block is never used by the pattern; use it or remove it")

    def expanded_blocks(self) -> list[tuple[str, BlockConfig]]:
        count = self.num_blocks or len(self.pattern)
        return [(name, self.blocks[name]) for name in (self.pattern * count)[:count]]


@configclass
class EmbeddingsConfig(Config):
    vocab_size: int = field(49152, doc="Number of token ids.", validator=at_least(1))
    word_embeddings: ParameterConfig = field(factory=ParameterConfig, doc="The token embedding table.")
    position_embeddings: bool = field(False, doc="Add learned absolute position embeddings.")
    num_position_embeddings: int = field(2048, doc="Positions the learned table covers.", validator=at_least(1))
    multiplier: float = field(1.0, doc="Scales the embeddings before the first block (Granite, Falcon-H1).")
    lr_scale: float | None = field(
        None, doc="Multiplies the model's learning-rate scale; 0 freezes.", validator=at_least(0)
    )


@configclass
class HeadConfig(Config):
    normalization: NormalizationConfig = field(
        factory=_default_of(NormalizationConfig, "normalization"), doc="The final normalization."
    )
    output_weight: ParameterConfig = field(factory=ParameterConfig, doc="The output projection (when not tied).")
    logits_multiplier: float = field(
        1.0,
        doc="Scales the logits, before the loss too (Falcon-H1's lm_head_multiplier; Granite's 1 / logits_scaling).",
    )
    lr_scale: float | None = field(
        None, doc="Multiplies the model's learning-rate scale; 0 freezes.", validator=at_least(0)
    )


@configclass
class ModelConfig(Config):
    """A language model: embeddings → block sequence → head."""

    hidden_size: int = field(1024, doc="Width of the residual stream.", validator=at_least(1))
    tied_embedding_weight: bool = field(False, doc="The output projection reuses the embedding table.")
    embeddings: EmbeddingsConfig = field(factory=EmbeddingsConfig, doc="Token (and position) embeddings.")
    decoder: BlockSequenceConfig = field(
        factory=_default_of(BlockSequenceConfig, "decoder"), doc="The blocks (`fixed` or `pattern`)."
    )
    head: HeadConfig = field(factory=HeadConfig, doc="Final norm and output projection.")
    lr_scale: float | None = field(
        None, doc="Learning-rate scale of the whole model; 0 freezes.", validator=at_least(0)
    )
    peft: PeftConfig | None = field(
        None,
        doc="Fine-tune with this method (`{type: lora, rank, alpha, dropout}`): adapters on every linear whose "
        "`apply_peft` resolves true (attention's query and value by default), every other weight frozen.",
    )
    pretrained: str | None = field(
        None,
        doc="Start from this checkpoint: a blockzoo checkpoint or run directory, or a Hugging Face directory. Its "
        "model config, updated with the fields given beside this one, and its weights. Consumed when the model is "
        "built: the built model's config (and its checkpoints) has none.",
    )
    preset: str | None = field(
        None,
        doc="Start from this named architecture (`blockzoo models` lists them: `qwen3_0_6b`, `falcon_h1_1_5b`, ...): "
        "the fields given beside this one are merged into the preset's own config (`decoder: {num_blocks: 4}`).",
    )

    @classmethod
    def complete_data(cls, data: Mapping[str, Any]) -> Mapping[str, Any]:
        """With `preset`: the fields given merged into the preset's model config (its own types, so a partial
        section updates them). With `pretrained`: the fields given merged into the checkpoint's own model config,
        so a partial section (`decoder: {blocks: {attn: {mixer: {window_size: 512}}}}`) updates the checkpoint's
        types instead of being read as the defaults. A checkpoint that cannot be read here is reported when the model
        is built."""
        if (preset := data.get("preset")) is not None and not _complete(cls, data):
            data = _with_preset(preset, data)
        source = data.get("pretrained")
        if not isinstance(source, str):
            return data
        from blockzoo.model.factory import pretrained_model_config  # reads a checkpoint: imports torch

        try:
            pretrained = pretrained_model_config(source)
        except Exception:  # noqa: BLE001 - said, with its cause, where the weights are read
            return data
        return merge({key: value for key, value in pretrained.items() if key != "pretrained"}, data)

    def __attrs_post_init__(self) -> None:
        if self.preset is not None and self.pretrained is not None:
            raise ConfigFieldError(
                "preset", "give either a preset or a pretrained checkpoint (which has its own architecture), not both"
            )
        if self.tied_embedding_weight and self.head.output_weight != ParameterConfig():
            raise ConfigFieldError(
                "head.output_weight",
                "has no effect with tied_embedding_weight: true (the output reuses embeddings.word_embeddings); "
                "remove it or untie the weights",
            )


def _complete(cls: type, data: Mapping[str, Any]) -> bool:
    """Whether a model section gives every field, its decoder's type too: a checkpoint's config.yaml, written whole.
    Its `preset` is a record of where it started, not read again, so it loads where the preset is not installed or
    has changed since (a section written by hand names the preset to get the rest from it)."""
    fields = {attribute.name for attribute in attrs.fields(cls)}
    decoder = data.get("decoder")
    return data.keys() >= fields and isinstance(decoder, Mapping) and "type" in decoder


def _with_preset(name: Any, data: Mapping[str, Any]) -> dict[str, Any]:
    """`data` merged over the model config of preset `name` (an unknown or unavailable one: an error at `preset`)."""
    from blockzoo.errors import UsageError
    from blockzoo.presets import model_data

    if not isinstance(name, str):
        raise ConfigFieldError("preset", f"a preset name is a string, got {name!r}")
    try:
        preset = model_data(name)
    except UsageError as error:
        raise ConfigFieldError("preset", str(error)) from None
    return merge(preset, data)
