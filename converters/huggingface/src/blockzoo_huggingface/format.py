"""A Hugging Face format: config.json ↔ blockzoo model config, safetensors ↔ parameters, through sections.

The model-level keys come from the format's model section (`sections.transformer_model`), the layers' from the
layout (`layouts`), each layer's block from the decoder-block section of the format, and within it each part
from the section its plugin registered. Importing checks that every key of config.json is claimed by one of
them; exporting, that every field of the blockzoo config is. The weights are `weights.py`'s job. Torch-free (the
registry imports this module with the plugin).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from blockzoo.api import get_registry
from blockzoo.conversion import (
    CheckpointFormat,
    ConversionError,
    Origin,
    Section,
    WeightMapping,
    claimed_keys,
    expand_weights,
    export_config,
    ignored_keys,
    import_config,
    merge_keys,
    read_json,
    section_for,
)
from blockzoo.model.config import DecoderBlockConfig, ModelConfig
from blockzoo_huggingface import versions
from blockzoo_huggingface.layouts import Layer, Layout
from blockzoo_huggingface.sections import decoder_block, rms_norm, transformer_model

CONFIG_JSON = "config.json"

# Keys of every transformers config (4.x and 5.x) that do not describe the model: names, labels, output and
# generation options, token ids, the version and dtype.
GENERIC_KEYS = frozenset(
    {
        "_name_or_path",
        "add_cross_attention",
        "architectures",
        "bad_words_ids",
        "begin_suppress_tokens",
        "bos_token_id",
        "chunk_size_feed_forward",
        "cross_attention_hidden_size",
        "decoder_start_token_id",
        "diversity_penalty",
        "do_sample",
        "dtype",
        "early_stopping",
        "encoder_no_repeat_ngram_size",
        "eos_token_id",
        "exponential_decay_length_penalty",
        "finetuning_task",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "id2label",
        "is_decoder",
        "is_encoder_decoder",
        "label2id",
        "length_penalty",
        "max_length",
        "min_length",
        "model_type",
        "no_repeat_ngram_size",
        "num_beam_groups",
        "num_beams",
        "num_return_sequences",
        "output_attentions",
        "output_hidden_states",
        "output_scores",
        "pad_token_id",
        "prefix",
        "problem_type",
        "pruned_heads",
        "remove_invalid_values",
        "repetition_penalty",
        "return_dict",
        "return_dict_in_generate",
        "sep_token_id",
        "suppress_tokens",
        "task_specific_params",
        "temperature",
        "tf_legacy_loss",
        "tie_encoder_decoder",
        "tokenizer_class",
        "top_k",
        "top_p",
        "torchscript",
        "transformers_version",
        "typical_p",
        "use_bfloat16",
        "use_cache",
    }
)

# Files of a checkpoint directory kept with a model imported from it and written back by its exports, besides
# config.json: the tokenizer, generation settings, the license, and the remote code an `auto_map` names.
COMPANION_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.tiktoken",
    "chat_template.jinja",
    "chat_template.json",
    "LICENSE*",
    "NOTICE*",
    "configuration_*.py",
    "modeling_*.py",
    "tokenization_*.py",
)


# The names transformers' configs give the activations (`hidden_act`), by blockzoo's `activation`.
TRANSFORMERS_ACTIVATIONS = {
    "silu": "silu",
    "gelu": "gelu",
    "relu": "relu",
    "squared_relu": "relu2",
    "identity": "linear",
}
TRANSFORMERS_ACTIVATION_ALIASES = {"swish": "silu"}


@attrs.frozen(kw_only=True)
class HuggingfaceFormat(CheckpointFormat):
    """One transformers architecture (`model_type`, `architecture`) as a blockzoo checkpoint format `name`.

    `layout`: the layers. `block_class`: the config class of every layer's block (`DecoderBlockConfig`, or
    Falcon-H1's `ParallelBlockConfig`), converted by its section in `core_sections`. `model_section`: the
    `ModelConfig` section (model-level keys, the weights around the layers). `core_sections`: the sections of the
    core's config classes (decoder block, normalization) in this format, registered with it; the mixers' and MLPs'
    come from their plugins. `defaults`: transformers' values of keys a config.json may omit. `default_rope_theta`:
    the RoPE base when a 4.x config omits it (None: no RoPE). `legacy`: the format's own changes for transformers
    4.x. `ignored_tensors`: tensors of old checkpoints that hold nothing (regular expressions).
    """

    name: str
    model_type: str
    architecture: str
    layout: Layout
    block_class: type = DecoderBlockConfig
    model_section: Section = attrs.field(factory=transformer_model)
    core_sections: tuple[Section, ...] = attrs.field(factory=lambda: (decoder_block(), rms_norm()))
    defaults: Mapping[str, Any] = attrs.field(factory=lambda: {"rms_norm_eps": 1e-6})
    default_rope_theta: float | None = 10000.0
    legacy: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    ignored_tensors: tuple[str, ...] = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)
    description: str = ""

    # -- configs ---------------------------------------------------------------------------------------------------

    def recognizes(self, directory: Path) -> bool:
        path = Path(directory) / CONFIG_JSON
        if not path.is_file():
            return False
        try:
            return read_json(path).get("model_type") == self.model_type
        except ConversionError:
            return False

    def value_names(self, vocabulary: str) -> tuple[Mapping[str, str], Mapping[str, str]]:
        """transformers' names: of the activations (`hidden_act`: `ACT2FN`'s keys), the only vocabulary."""
        if vocabulary != "activation":
            return super().value_names(vocabulary)
        return TRANSFORMERS_ACTIVATIONS, TRANSFORMERS_ACTIVATION_ALIASES

    def describe_unread(self, directory: Path) -> str | None:
        """A directory with a config.json and no blockzoo metadata.yaml is a Hugging Face checkpoint (of its
        `model_type`, when it names one)."""
        directory = Path(directory)
        if (directory / "metadata.yaml").is_file() or not (directory / CONFIG_JSON).is_file():
            return None
        try:
            model_type = read_json(directory / CONFIG_JSON).get("model_type")
        except ConversionError:
            model_type = None
        return f"a Hugging Face checkpoint of model_type {model_type!r}" if model_type else "a Hugging Face checkpoint"

    def origin(self, directory: Path) -> Origin:
        """config.json and the companion files (`COMPANION_FILES`) of the directory."""
        directory = Path(directory)
        companions = sorted(
            path.name
            for path in directory.iterdir()
            if path.is_file() and any(fnmatch.fnmatch(path.name, pattern) for pattern in COMPANION_FILES)
        )
        return Origin(directory, (CONFIG_JSON, *companions))

    def read_model_config(self, directory: Path) -> dict[str, Any]:
        return self.import_config(read_json(Path(directory) / CONFIG_JSON), source=str(directory))

    def import_config(self, config_json: Mapping[str, Any], *, source: str = "config.json") -> dict[str, Any]:
        """Plain data of the blockzoo `ModelConfig` from a config.json (either transformers version)."""
        if config_json.get("model_type") != self.model_type:
            raise ConversionError(
                f"{source}: model_type {config_json.get('model_type')!r}, expected {self.model_type!r} ({self.name})"
            )
        config = versions.standardize({**self.defaults, **config_json}, self.default_rope_theta)
        known = GENERIC_KEYS | self.model_section.claimed_keys | set(self.layout.claims) | claimed_keys(self.name)
        if unknown := sorted(set(config) - known):
            raise ConversionError(
                f"{source}: config.json keys {', '.join(map(repr, unknown))} are not understood by the {self.name} "
                "conversion (a variant of the architecture blockzoo cannot express, or a newer transformers)"
            )
        try:
            data = import_config(self.name, self.model_section, config)
            block = section_for(self.name, self.block_class)
            blocks = [
                import_config(self.name, block, layer.config, types=layer.types, path=f"decoder.{index}")
                for index, layer in enumerate(self.layout.layers(config))
            ]
        except ConversionError as error:
            raise ConversionError(f"{source}: {error}") from None
        data["decoder"] = _decoder(blocks)
        return data

    def check_model_config(self, config: ModelConfig) -> None:
        self.export_config(config)

    def export_config(
        self,
        model: ModelConfig,
        *,
        transformers_version: str | None = None,
        origin: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The config.json of a blockzoo model config, for the given (default: installed) transformers version.
        `origin`: the config.json the model was imported from, whose keys that no field holds (token ids, maximum
        length, ...) are written back."""
        config = export_config(self.name, model, section=self.model_section, claimed=("decoder",))
        origins = dict.fromkeys(config, "the model")
        layers = []
        for index, (_, block) in enumerate(model.decoder.expanded_blocks()):
            keys = export_config(self.name, block, path=f"decoder.{index}")
            layers.append(Layer(_part_types(block), keys))
        merge_keys(config, origins, self.layout.merge(layers, self.name), "the layers")
        version = versions.target_version(transformers_version)
        config.update(
            architectures=[self.architecture],
            model_type=self.model_type,
            transformers_version=str(version),
            dtype="float32",
        )
        if origin is not None:
            config = {**self._carried(origin), **config}
        if version.major < 5:
            config = versions.legacy(config)
            if self.legacy is not None:
                config = self.legacy(config)
        return dict(sorted(config.items()))

    def _carried(self, origin: Mapping[str, Any]) -> dict[str, Any]:
        """The keys of an origin config.json that no field holds and this format knows: the generic ones and those
        its sections ignore."""
        carried = (GENERIC_KEYS | self.model_section.ignored_keys | ignored_keys(self.name)) - {"_name_or_path"}
        origin = versions.standardize(dict(origin), self.default_rope_theta)
        return {key: value for key, value in origin.items() if key in carried}

    # -- weights (weights.py, imported on first use: it needs torch, and does not import this module) --------------

    def weight_mappings(self, model: ModelConfig) -> list[WeightMapping]:
        """Every weight mapping of the model, with full names. A tensor claimed twice is a section bug."""
        mappings = expand_weights(self.name, model, section=self.model_section)
        seen: set[str] = set()
        for name in (name for mapping in mappings for name in mapping.theirs):
            if name in seen:
                raise ConversionError(f"tensor {name!r} is claimed twice in the {self.name} format (a section bug)")
            seen.add(name)
        return mappings

    def ignored_tensor(self, model: ModelConfig) -> re.Pattern:
        """The tensors a checkpoint may hold that carry nothing for this model."""
        patterns = list(self.ignored_tensors)
        if model.tied_embedding_weight:  # transformers ties it on load, whatever the file holds
            patterns.append(r"lm_head\.weight")
        return re.compile("|".join(f"(?:{pattern})" for pattern in patterns))

    def load_weights(self, directory: Path, model: Any, distributed: Any) -> None:
        from blockzoo_huggingface import weights

        weights.load_weights(self, Path(directory), model, distributed)

    def import_checkpoint(self, source: Path, destination: Path) -> Path:
        from blockzoo_huggingface import weights

        return weights.import_checkpoint(self, Path(source), Path(destination))

    def save(self, model: Any, directory: Path, **options: Any) -> Path:
        """`options`: `dtype` ("float32", "bfloat16", "float16"), `transformers_version` (default: installed),
        `max_shard_size` (bytes)."""
        from blockzoo_huggingface import weights

        return weights.save(self, model, Path(directory), **options)

    def export_checkpoint(self, source: Path, destination: Path, **options: Any) -> Path:
        """`options` as `save`."""
        from blockzoo_huggingface import weights

        return weights.export_checkpoint(self, Path(source), Path(destination), **options)

    def save_adapters(self, model: Any, directory: Path, *, base_model: str | None = None) -> Path:
        """Hugging Face PEFT files: `adapter_config.json` + `adapter_model.safetensors` (`adapters.save_adapters`)."""
        from blockzoo_huggingface import adapters

        return adapters.save_adapters(model, Path(directory), self.name, base_model=base_model)


def _part_types(block: Any) -> dict[str, str]:
    """The registered type of each part of a block: `mixer` and `mlp` (a decoder block's), `mixers.<name>` (a
    parallel block's)."""
    registry = get_registry()
    types = {part: registry.name_of(type(getattr(block, part))) for part in ("mixer", "mlp") if hasattr(block, part)}
    for name, mixer in getattr(block, "mixers", {}).items():
        types[f"mixers.{name}"] = registry.name_of(type(mixer))
    return types


def _decoder(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """A `fixed` decoder when every layer's block is the same, else a `pattern` of the distinct blocks (named by
    their mixer and MLP types), cut to its shortest period."""
    if all(block == blocks[0] for block in blocks):
        return {"type": "fixed", "block": blocks[0], "num_blocks": len(blocks)}
    named: dict[str, dict[str, Any]] = {}
    pattern = []
    for block in blocks:
        name = next((name for name, known in named.items() if known == block), None)
        if name is None:
            base = f"{block['mixer']['type']}_{block['mlp']['type']}"
            name = base if base not in named else f"{base}_{sum(n.startswith(base) for n in named) + 1}"
            named[name] = block
        pattern.append(name)
    period = next(p for p in range(1, len(pattern) + 1) if all(n == pattern[i % p] for i, n in enumerate(pattern)))
    return {"type": "pattern", "blocks": named, "pattern": pattern[:period], "num_blocks": len(blocks)}
