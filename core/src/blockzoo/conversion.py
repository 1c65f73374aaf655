"""Declarative conversions between blockzoo and other checkpoint formats (DESIGN.md "Checkpoints and formats").

A converter plugin provides *formats*: a `CheckpointFormat` (e.g. Hugging Face's `llama`) reads and writes whole
checkpoints. What a format cannot know, how each mixer, MLP or normalization is written there, comes from
*sections*: a `Section` says, for one config class in one format, which config fields map to which keys of the
format's config, and which parameters to which tensors. The plugin that owns a config class contributes its
sections from its `register_converters(register)` hook, `register(format_name, section)`; the converter plugin
registers each format the same way, `register(format_name, checkpoint_format)`, and composes the sections.

A section is data:
- `config`: config mappings, each claiming blockzoo fields (`ours`, dotted paths relative to the section's config)
  and format keys (`theirs`): `Rename`, `Constant` (a blockzoo value the format implies), `Fixed` (a format value
  blockzoo implies), `Ignored` (claimed, not converted, with the reason) and `Computed` (anything else).
- `parts`: fields holding other polymorphic configs (a block's mixer, a query norm), converted by the section
  registered for their own class in the same format.
- `weights(config)`: weight mappings for a config, parameter names (relative to the section's module) to tensor
  names (relative to the format's module `name`): `Weight` (one to one), `Concatenated` (key‖value, gate‖up, the
  experts of a MoE one tensor each, optionally transposed), `ComputedWeights`, and `Nested` (a sub-module
  converted by its own section).

Coverage is checked, never assumed: exporting a config, every field that describes the architecture (all but
`lr_scale`, `initialization`, `weight_decay`, `apply_peft`, `peft`) must be claimed, and every value the format cannot
express is an error naming the field; importing, every key of the format's config must be claimed by some section
of the format (`claimed_keys`), and the converter checks that every tensor is claimed and every parameter made.

Torch-free: weight mappings use torch only when they run (on the tensors they are given).
"""

from __future__ import annotations

import copy
import json
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from blockzoo.config import Config, PolymorphicConfig
from blockzoo.errors import UsageError
from blockzoo.plugins import ConverterEntry, get_registry

# Fields that set how a model trains, never what it computes: no format holds them.
TRAINING_FIELDS = frozenset({"lr_scale", "initialization", "weight_decay", "apply_peft", "peft"})

_REQUIRED = object()


class ConversionError(UsageError):
    """A config or checkpoint cannot be converted as asked; the message names the field, key or tensor."""


# ---------------------------------------------------------------------------------------------------------------------
# Config mappings


@attrs.frozen(kw_only=True)
class ConfigMapping:
    """Claims blockzoo fields `ours` (dotted paths) and format keys `theirs`, and converts between them."""

    ours: tuple[str, ...] = ()
    theirs: tuple[str, ...] = ()

    def import_values(self, data: Mapping[str, Any]) -> dict[str, Any]:
        """{blockzoo path: value} from the format's config `data`."""
        return {}

    def export_values(self, config: Config) -> dict[str, Any]:
        """{format key: value} from the blockzoo `config`; raises `ConversionError` for what cannot be written."""
        return {}


@attrs.frozen(kw_only=True, init=False)
class Rename(ConfigMapping):
    """A field and a key holding the same value. `default`: the format's value when the key is absent."""

    default: Any = _REQUIRED

    def __init__(self, ours: str, theirs: str, *, default: Any = _REQUIRED):
        self.__attrs_init__(ours=(ours,), theirs=(theirs,), default=default)

    def import_values(self, data: Mapping[str, Any]) -> dict[str, Any]:
        key = self.theirs[0]
        if key in data:
            return {self.ours[0]: data[key]}
        if self.default is _REQUIRED:
            raise ConversionError(f"`{key}` is missing from the config")
        return {self.ours[0]: self.default}

    def export_values(self, config: Config) -> dict[str, Any]:
        return {self.theirs[0]: get_path(config, self.ours[0])}


@attrs.frozen(kw_only=True, init=False)
class Constant(ConfigMapping):
    """A blockzoo field the format implies: set on import; exporting any other value is an error."""

    value: Any = None

    def __init__(self, ours: str, value: Any):
        self.__attrs_init__(ours=(ours,), value=value)

    def import_values(self, data: Mapping[str, Any]) -> dict[str, Any]:
        return {self.ours[0]: self.value}

    def export_values(self, config: Config) -> dict[str, Any]:
        actual = get_path(config, self.ours[0])
        if actual != self.value:
            raise ConversionError(
                f"`{self.ours[0]}` = {actual!r} cannot be written: the format has only {self.value!r}"
            )
        return {}


@attrs.frozen(kw_only=True, init=False)
class Fixed(ConfigMapping):
    """A format key blockzoo implies: written on export; importing another value is an error (absent is fine)."""

    value: Any = None

    def __init__(self, theirs: str, value: Any):
        self.__attrs_init__(theirs=(theirs,), value=value)

    def import_values(self, data: Mapping[str, Any]) -> dict[str, Any]:
        key = self.theirs[0]
        if key in data and data[key] != self.value:
            raise ConversionError(f"`{key}` = {data[key]!r} is not supported (only {self.value!r})")
        return {}

    def export_values(self, config: Config) -> dict[str, Any]:
        return {self.theirs[0]: self.value}


@attrs.frozen(kw_only=True, init=False)
class Ignored(ConfigMapping):
    """Fields and keys claimed on purpose and not converted: training settings, informational keys. Say why."""

    reason: str = ""

    def __init__(self, *, ours: Sequence[str] = (), theirs: Sequence[str] = (), reason: str):
        self.__attrs_init__(ours=tuple(ours), theirs=tuple(theirs), reason=reason)


@attrs.frozen(kw_only=True, init=False)
class Computed(ConfigMapping):
    """Anything else. `import_`: the format's config -> {blockzoo path: value}; `export`: the config -> {key: value}.

    `import_` may read keys it does not claim (claimed elsewhere), `export` fields it does not claim.
    """

    import_: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None
    export: Callable[[Any], Mapping[str, Any]] | None = None

    def __init__(
        self,
        ours: Sequence[str],
        theirs: Sequence[str],
        *,
        import_: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
        export: Callable[[Any], Mapping[str, Any]] | None = None,
    ):
        self.__attrs_init__(ours=tuple(ours), theirs=tuple(theirs), import_=import_, export=export)

    def import_values(self, data: Mapping[str, Any]) -> dict[str, Any]:
        return dict(self.import_(data)) if self.import_ is not None else {}

    def export_values(self, config: Config) -> dict[str, Any]:
        return dict(self.export(config)) if self.export is not None else {}


# The names Hugging Face configs give the MLP activations (`hidden_act`), shared by the MLP and MoE sections.
TRANSFORMERS_ACTIVATIONS = {
    "silu": "silu",
    "gelu": "gelu",
    "relu": "relu",
    "squared_relu": "relu2",
    "identity": "linear",
}
_TRANSFORMERS_ACTIVATION_ALIASES = {"swish": "silu"}


def transformers_activation(theirs: str = "hidden_act") -> Computed:
    """The `activation` field ↔ a Hugging Face activation name."""

    def import_(data: Mapping[str, Any]) -> dict[str, Any]:
        name = data.get(theirs, "silu")
        ours = {value: key for key, value in TRANSFORMERS_ACTIVATIONS.items()}.get(
            _TRANSFORMERS_ACTIVATION_ALIASES.get(name, name)
        )
        if ours is None:
            raise ConversionError(
                f"`{theirs}` = {name!r} is not supported (blockzoo has {', '.join(TRANSFORMERS_ACTIVATIONS.values())})"
            )
        return {"activation": ours}

    return Computed(("activation",), (theirs,), import_=import_, export=lambda c: {theirs: _activation_name(c)})


def _activation_name(config: Any) -> str:
    return TRANSFORMERS_ACTIVATIONS[config.activation]


# ---------------------------------------------------------------------------------------------------------------------
# Weight mappings


@attrs.frozen(kw_only=True)
class WeightMapping:
    """Parameters `ours` ↔ tensors `theirs`. `import_tensors` maps theirs (in order) to ours, `export_tensors` back."""

    ours: tuple[str, ...]
    theirs: tuple[str, ...]

    def import_tensors(self, tensors: Sequence[Any]) -> list[Any]:
        raise NotImplementedError

    def export_tensors(self, tensors: Sequence[Any]) -> list[Any]:
        raise NotImplementedError

    def prefixed(self, ours: str, theirs: str) -> WeightMapping:
        """The same mapping with full names: `ours` and `theirs` (module paths, maybe empty) put before each name."""
        renamed = copy.copy(self)
        object.__setattr__(renamed, "ours", tuple(join(ours, name) for name in self.ours))
        object.__setattr__(renamed, "theirs", tuple(join(theirs, name) for name in self.theirs))
        return renamed


@attrs.frozen(kw_only=True, init=False)
class Weight(WeightMapping):
    """One parameter, one tensor, the same values."""

    def __init__(self, ours: str, theirs: str):
        self.__attrs_init__(ours=(ours,), theirs=(theirs,))

    def import_tensors(self, tensors: Sequence[Any]) -> list[Any]:
        return list(tensors)

    def export_tensors(self, tensors: Sequence[Any]) -> list[Any]:
        return list(tensors)


@attrs.frozen(kw_only=True, init=False)
class Concatenated(WeightMapping):
    """One parameter that is the tensors `theirs` laid end to end along dim 0 (key‖value, gate‖up, experts).

    `transposed`: each tensor is transposed first (a MoE's down projections, stored [hidden, intermediate]).
    `sizes`: the rows each tensor takes in the parameter; None: equal parts.
    """

    transposed: bool = False
    sizes: tuple[int, ...] | None = None

    def __init__(
        self, ours: str, theirs: Sequence[str], *, transposed: bool = False, sizes: Sequence[int] | None = None
    ):
        if sizes is not None and len(sizes) != len(theirs):
            raise ValueError(f"Concatenated {ours!r}: {len(sizes)} sizes for {len(theirs)} tensors")
        self.__attrs_init__(
            ours=(ours,), theirs=tuple(theirs), transposed=transposed, sizes=None if sizes is None else tuple(sizes)
        )

    def import_tensors(self, tensors: Sequence[Any]) -> list[Any]:
        import torch

        return [torch.cat([tensor.t() if self.transposed else tensor for tensor in tensors])]

    def export_tensors(self, tensors: Sequence[Any]) -> list[Any]:
        (tensor,) = tensors
        sizes = self.sizes
        if sizes is None:
            if len(tensor) % len(self.theirs):
                raise ConversionError(
                    f"{self.ours[0]}: {len(tensor)} rows cannot be split into {len(self.theirs)} equal tensors"
                )
            sizes = [len(tensor) // len(self.theirs)] * len(self.theirs)
        parts = tensor.split(list(sizes))
        return [(part.t() if self.transposed else part).contiguous() for part in parts]


@attrs.frozen(kw_only=True, init=False)
class ComputedWeights(WeightMapping):
    """Anything else: `import_` maps the tensors `theirs` (in order) to `ours`, `export` back."""

    import_: Callable[[Sequence[Any]], Sequence[Any]]
    export: Callable[[Sequence[Any]], Sequence[Any]]

    def __init__(
        self,
        ours: Sequence[str],
        theirs: Sequence[str],
        *,
        import_: Callable[[Sequence[Any]], Sequence[Any]],
        export: Callable[[Sequence[Any]], Sequence[Any]],
    ):
        self.__attrs_init__(ours=tuple(ours), theirs=tuple(theirs), import_=import_, export=export)

    def import_tensors(self, tensors: Sequence[Any]) -> list[Any]:
        return list(self.import_(tensors))

    def export_tensors(self, tensors: Sequence[Any]) -> list[Any]:
        return list(self.export(tensors))


@attrs.frozen
class Nested:
    """The weights of a sub-module `ours` (its config `config`), converted by the section of the config's class,
    under the format's module `theirs` (None: that section's `name`)."""

    ours: str
    config: Any
    theirs: str | None = None


# ---------------------------------------------------------------------------------------------------------------------
# Sections


@attrs.frozen
class Part:
    """A field holding a polymorphic config converted by its own section. `type`: its registered type name when the
    format fixes it (importing; exporting another type is an error); None when the format chooses per layer."""

    field: str
    type: str | None = None


@attrs.frozen(kw_only=True)
class Section:
    """How one config class is written in one format: its config fields, its sub-configs and its weights.

    `name`: the format's module name for what this section converts (Hugging Face `self_attn`, `mlp`), where its
    weights go unless the parent says otherwise. `weights(config)` lists the weight mappings of a config.
    """

    config_class: type
    name: str | None = None
    config: tuple[ConfigMapping, ...] = ()
    parts: tuple[Part, ...] = ()
    weights: Callable[[Any], Sequence[WeightMapping | Nested]] | None = None

    @property
    def claimed_fields(self) -> frozenset[str]:
        return frozenset(path for mapping in self.config for path in mapping.ours) | {part.field for part in self.parts}

    @property
    def claimed_keys(self) -> frozenset[str]:
        return frozenset(key for mapping in self.config for key in mapping.theirs)

    @property
    def ignored_keys(self) -> frozenset[str]:
        return frozenset(key for mapping in self.config if isinstance(mapping, Ignored) for key in mapping.theirs)


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
        available = ", ".join(["blockzoo", *formats])
        hint = "" if formats else " (the Hugging Face formats come with blockzoo-huggingface)"
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


# ---------------------------------------------------------------------------------------------------------------------
# Converting configs through sections


def import_config(
    format: str,
    section: Section,
    data: Mapping[str, Any],
    *,
    types: Mapping[str, str] | None = None,
    path: str = "",
) -> dict[str, Any]:
    """Plain data of `section.config_class` (structure it) from the format's config `data`.

    `types`: the registered type name of each part the format chooses per layer (e.g. {"mlp": "moe"}).
    """
    types = types or {}
    result: dict[str, Any] = {}
    if issubclass(section.config_class, PolymorphicConfig):
        result["type"] = get_registry().name_of(section.config_class)
    for mapping in section.config:
        try:
            values = mapping.import_values(data)
        except ConversionError as error:
            raise ConversionError(f"{_where(path)}{error}") from None
        for field_path, value in values.items():
            _set_path(result, field_path, value, path)
    for part in section.parts:
        name = part.type or types.get(part.field)
        if name is None:
            raise ConversionError(f"{_where(path)}the {format} format gives no type for `{part.field}`")
        kind = _field_kind(section.config_class, part.field)
        config_class = get_registry().resolve(kind, name).config_class
        nested_types = {
            key[len(part.field) + 1 :]: value for key, value in types.items() if key.startswith(f"{part.field}.")
        }
        value = import_config(
            format,
            section_for(format, config_class, join(path, part.field)),
            data,
            types=nested_types,
            path=join(path, part.field),
        )
        _set_path(result, part.field, value, path)
    return result


def export_config(
    format: str, config: Config, *, section: Section | None = None, path: str = "", claimed: Iterable[str] = ()
) -> dict[str, Any]:
    """The format's config keys for `config`, through `section` (default: the one registered for its class).

    Every field that describes the architecture must be claimed (by the section, or by the caller in `claimed`),
    and a key written twice must have one value.
    """
    section = section or section_for(format, type(config), path)
    if unclaimed := unclaimed_fields(section, config, claimed):
        fields = ", ".join(f"`{join(path, field)}`" for field in unclaimed)
        raise ConversionError(
            f"the {format} conversion of {_type_label(type(config))} does not handle {fields}: nothing would write "
            "it (a section must claim every field)"
        )
    result: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for mapping in section.config:
        try:
            values = mapping.export_values(config)
        except ConversionError as error:
            raise ConversionError(f"{_where(path)}{error} ({format} format)") from None
        merge_keys(result, origins, values, path or "the model")
    for part in section.parts:
        value = get_path(config, part.field)
        part_path = join(path, part.field)
        if part.type is not None:
            name = get_registry().name_of(type(value)) if isinstance(value, PolymorphicConfig) else repr(value)
            if name != part.type:
                raise ConversionError(
                    f"{_where(part_path)}type {name!r} cannot be written in the {format} format (only {part.type!r})"
                )
        merge_keys(result, origins, export_config(format, value, path=part_path), part_path)
    return result


def merge_keys(result: dict[str, Any], origins: dict[str, str], values: Mapping[str, Any], origin: str) -> None:
    """Add `values` to `result`; a key already there must have the same value (`origins` says who wrote what)."""
    for key, value in values.items():
        if key in result and result[key] != value:
            raise ConversionError(
                f"`{key}` would be {result[key]!r} for {origins[key]} but {value!r} for {origin}; the format has one "
                "value for both"
            )
        result[key] = value
        origins.setdefault(key, origin)


def expand_weights(
    format: str, config: Config, *, ours: str = "", theirs: str | None = None, section: Section | None = None
) -> list[WeightMapping]:
    """Every weight mapping of `config` with full names: parameters under `ours`, tensors under `theirs` (None:
    the section's `name`), `Nested` mappings expanded through their own sections."""
    section = section or section_for(format, type(config), ours)
    prefix = section.name if theirs is None else theirs
    mappings: list[WeightMapping] = []
    for mapping in section.weights(config) if section.weights is not None else ():
        if isinstance(mapping, Nested):
            nested = section_for(format, type(mapping.config), join(ours, mapping.ours))
            nested_theirs = mapping.theirs if mapping.theirs is not None else nested.name
            mappings += expand_weights(
                format,
                mapping.config,
                ours=join(ours, mapping.ours),
                theirs=join(prefix or "", nested_theirs or ""),
                section=nested,
            )
        else:
            mappings.append(mapping.prefixed(ours, prefix or ""))
    return mappings


# ---------------------------------------------------------------------------------------------------------------------
# Helpers


def join(prefix: str, name: str) -> str:
    """`prefix.name`, either part maybe empty."""
    return f"{prefix}.{name}" if prefix and name else prefix or name


def get_path(config: Any, path: str) -> Any:
    """The value of a dotted field path of a config."""
    value = config
    for step in path.split("."):
        value = getattr(value, step)
    return value


def _set_path(data: dict[str, Any], field_path: str, value: Any, where: str) -> None:
    *parents, last = field_path.split(".")
    node = data
    for step in parents:
        node = node.setdefault(step, {})
    if last in node and node[last] != value:
        raise ConversionError(
            f"{_where(join(where, field_path))}two mappings give different values ({node[last]!r} and {value!r})"
        )
    node[last] = value


def _where(path: str) -> str:
    return f"{path}: " if path else ""


def _type_label(config_class: type) -> str:
    if issubclass(config_class, PolymorphicConfig) and get_registry().is_registered(config_class):
        return f"{config_class.kind} type {get_registry().name_of(config_class)!r}"
    return config_class.__name__


def unclaimed_fields(section: Section, config: Config, claimed: Iterable[str] = ()) -> list[str]:
    """Fields of `config` (dotted paths) that describe the architecture and that neither `section` nor `claimed`
    claims. A claimed path covers what is below it; a polymorphic sub-config must be claimed as a whole (its type is
    architecture too)."""
    return list(_unclaimed_fields(config, section.claimed_fields | set(claimed)))


def _unclaimed_fields(config: Config, claimed: frozenset[str], prefix: str = "") -> Iterable[str]:
    for attribute in attrs.fields(type(config)):
        path = join(prefix, attribute.name)
        if path in claimed or attribute.name in TRAINING_FIELDS:
            continue
        value = getattr(config, attribute.name)
        if isinstance(value, Config) and not isinstance(value, PolymorphicConfig):
            yield from _unclaimed_fields(value, claimed, path)
        else:
            yield path


def _field_kind(config_class: type, field_path: str) -> str:
    """The config kind (`mixer`, `normalization`, ...) a field of a config class holds, from its annotation."""
    owner = config_class
    for step in field_path.split("."):
        annotation = typing.get_type_hints(owner)[step]
        candidates = [annotation, *typing.get_args(annotation)]
        owner = next(
            (c for c in candidates if isinstance(c, type) and issubclass(c, Config)),
            None,
        )
        if owner is None:
            raise TypeError(f"{config_class.__name__}.{field_path} does not hold a config")
    if not issubclass(owner, PolymorphicConfig):
        raise TypeError(f"{config_class.__name__}.{field_path} is not a polymorphic config: it needs no Part")
    return owner.kind
