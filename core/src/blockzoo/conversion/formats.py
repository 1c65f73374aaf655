"""Checkpoint formats: the interface a converter plugin implements (`CheckpointFormat`), the files a model keeps from
the checkpoint it came from (`Origin`), and the formats and sections the plugins registered."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from blockzoo.config import PolymorphicConfig, structure
from blockzoo.conversion.mappings import ConversionError, Section
from blockzoo.plugins import ConverterEntry, get_registry
from blockzoo.plugins.providers import formats_hint


@attrs.frozen
class Origin:
    """The files of the checkpoint a model was imported from that are not its weights: the format's config, the
    tokenizer, generation settings. A model remembers them (`LanguageModel.origin`), native checkpoints keep copies
    (their `origin/` directory), and an export gives them back, so a fine-tuned model leaves with the tokenizer and
    token ids it came with. `files`: names in `directory`."""

    directory: Path
    files: tuple[str, ...]

    def paths(self) -> list[Path]:
        return [self.directory / name for name in self.files]


class CheckpointFormat:
    """A checkpoint format other than blockzoo's own (e.g. a Hugging Face architecture). A converter plugin
    registers one from `register_converters`: `register(name, format)`."""

    name: str
    description: str = ""

    def recognizes(self, directory: Path) -> bool:
        """Whether `directory` holds a checkpoint of this format."""
        raise NotImplementedError

    def origin(self, directory: Path) -> Origin | None:
        """The files of the checkpoint in `directory` to keep with a model imported from it (None: nothing)."""
        return None

    def value_names(self, vocabulary: str) -> tuple[Mapping[str, str], Mapping[str, str]]:
        """How this format names the values of `vocabulary` (e.g. "activation"): {blockzoo value: its name here}, and
        {another name the format accepts on import: the name it stands for}. For `FormatNames` mappings."""
        raise ConversionError(f"the {self.name} format names no {vocabulary} values")

    def describe_unread(self, directory: Path) -> str | None:
        """What `directory` is, in words (e.g. "a Hugging Face checkpoint of model_type 'gpt2'"), when it looks like a
        checkpoint of this format's family that no registered format recognizes; None otherwise. Optional: it lets
        `blockzoo.load` say what the directory is instead of taking it for a native checkpoint."""
        return None

    def load(self, directory: Path, distributed: Any = None) -> Any:
        """The model of the checkpoint in `directory`: built from `read_model_config`, filled by `load_weights`, with
        the checkpoint's `origin` files (in this process alone without `distributed`)."""
        from blockzoo.distributed.runtime import Distributed  # torch, when a model is loaded
        from blockzoo.layers.parameter import uninitialized
        from blockzoo.model.config import ModelConfig
        from blockzoo.python_api import build
        from blockzoo.run_config import RunConfig

        model_config = structure(self.read_model_config(directory), ModelConfig, source=str(directory), root="model")
        run_config = RunConfig(model=model_config)
        with uninitialized():
            model = build(
                run_config, distributed=distributed or Distributed(run_config.distributed, world_size=1, rank=0)
            )
        self.load_weights(directory, model, model.distributed)
        model.origin = self.origin(directory)
        return model

    def read_model_config(self, directory: Path) -> dict[str, Any]:
        """The blockzoo model config (plain data of `ModelConfig`) of the checkpoint in `directory`."""
        raise NotImplementedError

    def check_model_config(self, config: Any) -> None:
        """Raise `ConversionError`, naming the field, if a model of this `ModelConfig` cannot be written."""
        raise NotImplementedError

    def load_weights(self, directory: Path, model: Any, distributed: Any) -> None:
        """Fill `model`'s parameters (this rank's shards) from the checkpoint in `directory`."""
        raise NotImplementedError

    def save(self, model: Any, directory: Path, **options: Any) -> Path:
        """Write `model` (every rank calls it) as a checkpoint of this format in `directory`; `options` are the
        format's own (e.g. a dtype)."""
        raise NotImplementedError

    def import_checkpoint(self, source: Path, destination: Path) -> Path:
        """Convert the checkpoint in `source` into a native blockzoo checkpoint in `destination`."""
        raise NotImplementedError

    def export_checkpoint(self, source: Path, destination: Path, **options: Any) -> Path:
        """Convert the native blockzoo checkpoint in `source` into this format in `destination` (`options` as
        `save`)."""
        raise NotImplementedError

    def save_adapters(self, model: Any, directory: Path, *, base_model: str | None = None) -> Path:
        """Write the PEFT adapters of `model` (a fine-tuning, `model.peft`) in this format's own adapter files, for
        the export of its base model (`base_model`: where that base is, recorded for the loader). Optional."""
        raise ConversionError(f"the {self.name} format has no adapter files: export the merged model instead")


# ---------------------------------------------------------------------------------------------------------------------
# What the plugins registered


def _entries() -> list[ConverterEntry]:
    return list(get_registry().converters)


def _describe_plugin(entry: ConverterEntry) -> str:
    return f"plugin {entry.plugin.label}"


def checkpoint_formats() -> dict[str, CheckpointFormat]:
    """Every registered format by name."""
    formats: dict[str, ConverterEntry] = {}
    for entry in _entries():
        if not isinstance(entry.section, CheckpointFormat):
            continue
        if entry.format in formats:
            raise ConversionError(
                f"format {entry.format!r} is registered by both {_describe_plugin(formats[entry.format])} and "
                f"{_describe_plugin(entry)}; uninstall or disable one of them"
            )
        formats[entry.format] = entry
    return {name: entry.section for name, entry in sorted(formats.items())}


def get_format(name: str) -> CheckpointFormat:
    formats = checkpoint_formats()
    if name not in formats:
        others = [format for format in formats if format != "blockzoo"]  # (blockzoo's own, registered by the core)
        available = ", ".join(["blockzoo", *others])
        hint = "" if others else f" ({formats_hint()})"
        raise ConversionError(f"unknown checkpoint format {name!r}; available: {available}{hint}")
    return formats[name]


def sections(format: str) -> dict[type, Section]:
    """The sections registered for `format`, by config class."""
    found: dict[type, ConverterEntry] = {}
    for entry in _entries():
        if entry.format != format or isinstance(entry.section, CheckpointFormat):
            continue
        if not isinstance(entry.section, Section):
            raise ConversionError(
                f"{_describe_plugin(entry)} registered {entry.section!r} for format {format!r}: expected a "
                "blockzoo.api.Section or CheckpointFormat"
            )
        config_class = entry.section.config_class
        if config_class in found:
            raise ConversionError(
                f"the {format} conversion of {config_class.__name__} is registered by both "
                f"{_describe_plugin(found[config_class])} and {_describe_plugin(entry)}; uninstall or disable one"
            )
        found[config_class] = entry
    return {config_class: entry.section for config_class, entry in found.items()}


def section_for(format: str, config_class: type, path: str = "") -> Section:
    section = sections(format).get(config_class)
    if section is None:
        raise ConversionError(
            f"{_where(path)}{_type_label(config_class)} cannot be written in the {format} format "
            "(no installed plugin registers its conversion)"
        )
    return section


def claimed_keys(format: str) -> frozenset[str]:
    """Every format key claimed by a section registered for `format`."""
    return frozenset(key for section in sections(format).values() for key in section.claimed_keys)


def ignored_keys(format: str) -> frozenset[str]:
    """Every format key a section registered for `format` claims as `Ignored`."""
    return frozenset(key for section in sections(format).values() for key in section.ignored_keys)


def detect_format(directory: Path) -> CheckpointFormat | None:
    """The format of the checkpoint in `directory` (None if no format recognizes it)."""
    matches = [fmt for fmt in checkpoint_formats().values() if fmt.recognizes(directory)]
    if len(matches) > 1:
        raise ConversionError(f"{directory}: several formats read it: {', '.join(fmt.name for fmt in matches)}")
    return matches[0] if matches else None


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a file, with errors that name the file."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConversionError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConversionError(f"{path}: cannot be read: {error}") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _where(path: str) -> str:
    return f"{path}: " if path else ""


def _type_label(config_class: type) -> str:
    if issubclass(config_class, PolymorphicConfig) and get_registry().is_registered(config_class):
        return f"{config_class.kind} type {get_registry().name_of(config_class)!r}"
    return config_class.__name__
