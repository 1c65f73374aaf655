"""Sections of the core's own config classes in the Hugging Face formats: the model, the decoder block, the RMS
normalization (the mixers' and MLPs' sections come from their plugins). Torch-free."""

from __future__ import annotations

from typing import Any

from blockzoo.api import get_registry
from blockzoo.conversion import (
    ConfigMapping,
    Constant,
    Ignored,
    Nested,
    Part,
    Rename,
    Section,
    Weight,
    WeightMapping,
)
from blockzoo.layers.config import RMSNormalizationConfig
from blockzoo.model.config import DecoderBlockConfig, ModelConfig


def rms_norm(epsilon: str = "rms_norm_eps") -> Section:
    """An RMS norm: its epsilon in `epsilon`, its `weight`. No module name: its parent places it."""
    return Section(
        config_class=RMSNormalizationConfig,
        config=(Rename("epsilon", epsilon),),
        weights=lambda config: [Weight("weight", "weight")],
    )


def _is_none(config: Any) -> bool:
    return get_registry().name_of(type(config)) == "none"


# The multipliers of formats without them (every field needs a mapping): exporting any other value is refused.
NO_RESIDUAL_MULTIPLIER = Constant("residual_multiplier", 1.0)
NO_EMBEDDING_MULTIPLIER = Constant("embeddings.multiplier", 1.0)
NO_LOGITS_MULTIPLIER = Constant("head.logits_multiplier", 1.0)


def decoder_block(
    mixer_norm: str = "input_layernorm",
    mlp_norm: str = "post_attention_layernorm",
    *,
    residual_multiplier: ConfigMapping = NO_RESIDUAL_MULTIPLIER,
) -> Section:
    """norm → mixer → norm → MLP, Llama's layer: the norms `mixer_norm` and `mlp_norm` (of one config, blockzoo's
    `normalization`), the mixer and the MLP under their sections' names. Their types come from the layout.
    `residual_multiplier`: the format's key for it (Granite's), else 1."""

    def weights(config: DecoderBlockConfig) -> list[WeightMapping | Nested]:
        mappings: list[WeightMapping | Nested] = []
        if not _is_none(config.mixer):
            mappings += [Nested("norm_1", config.normalization, mixer_norm), Nested("mixer", config.mixer)]
        if not _is_none(config.mlp):
            mappings += [Nested("norm_2", config.normalization, mlp_norm), Nested("mlp", config.mlp)]
        return mappings

    return Section(
        config_class=DecoderBlockConfig,
        config=(
            Constant("post_mixer_normalization", None),
            Constant("post_mlp_normalization", None),
            residual_multiplier,
        ),
        parts=(Part("mixer"), Part("mlp"), Part("normalization", type="rms_norm")),
        weights=weights,
    )


def transformer_model(
    extra: tuple[ConfigMapping, ...] = (),
    *,
    prefix: str = "model",
    embeddings: str = "embed_tokens",
    final_norm: str = "norm",
    embedding_multiplier: ConfigMapping = NO_EMBEDDING_MULTIPLIER,
    logits_multiplier: ConfigMapping = NO_LOGITS_MULTIPLIER,
) -> Section:
    """The model around the layers, Llama's: `model.embed_tokens`, `model.layers.N`, `model.norm`, `lm_head`
    (absent when tied). `extra`: the format's own model-level keys; `prefix`, `embeddings`, `final_norm`: other
    module names (Mamba's `backbone`, `embeddings`, `norm_f`); `embedding_multiplier`, `logits_multiplier`: the
    format's keys for them (Granite's, Falcon-H1's), else 1."""

    def weights(config: ModelConfig) -> list[WeightMapping | Nested]:
        mappings: list[WeightMapping | Nested] = [
            Weight("embeddings.word_embeddings", f"{prefix}.{embeddings}.weight"),
            *(
                Nested(f"decoder.{index}", block, f"{prefix}.layers.{index}")
                for index, (_, block) in enumerate(config.decoder.expanded_blocks())
            ),
            Nested("head.normalization", config.head.normalization, f"{prefix}.{final_norm}"),
        ]
        if not config.tied_embedding_weight:
            mappings.append(Weight("head.output_weight", "lm_head.weight"))
        return mappings

    return Section(
        config_class=ModelConfig,
        config=(
            Rename("hidden_size", "hidden_size"),
            Rename("tied_embedding_weight", "tie_word_embeddings", default=False),
            Rename("embeddings.vocab_size", "vocab_size"),
            Constant("embeddings.position_embeddings", False),
            embedding_multiplier,
            logits_multiplier,
            Ignored(ours=("embeddings.num_position_embeddings",), reason="used by learned position embeddings only"),
            Ignored(ours=("pretrained",), reason="where the initial weights came from, not the architecture"),
            Ignored(ours=("preset",), reason="the named architecture the fields came from; they are written"),
            Ignored(
                theirs=("max_position_embeddings", "initializer_range"),
                reason="they do not change what the model computes",
            ),
            *extra,
        ),
        parts=(Part("head.normalization", type="rms_norm"),),
        weights=weights,
    )
