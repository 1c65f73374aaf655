"""Config and weight mappings, and the sections made of them: how one config class is written in one checkpoint
format (see `blockzoo.conversion`). Torch-free: weight mappings use torch only when they run."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from blockzoo.config import Config
from blockzoo.errors import UsageError

# Fields that set how a model trains, never what it computes: no format holds them.
TRAINING_FIELDS = frozenset({"lr_scale", "initialization", "weight_decay", "apply_peft", "peft", "fp8"})

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

    def for_format(self, format: str) -> ConfigMapping:
        """This mapping as format `format` converts it (itself, unless its values are named by the format)."""
        return self


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


@attrs.frozen(kw_only=True, init=False)
class FormatNames(ConfigMapping):
    """A field whose values the format names in its own words (an activation function): the format says which name
    each value has (`CheckpointFormat.value_names(vocabulary)`), so the section holds no format's table.
    `default`: the format's name when the key is absent."""

    vocabulary: str = ""
    default: str | None = None

    def __init__(self, ours: str, theirs: str, vocabulary: str, *, default: str | None = None):
        self.__attrs_init__(ours=(ours,), theirs=(theirs,), vocabulary=vocabulary, default=default)

    def for_format(self, format: str) -> ConfigMapping:
        from blockzoo.conversion.formats import get_format  # the registered formats: a module above this one

        names, aliases = get_format(format).value_names(self.vocabulary)
        ours_of = {theirs: ours for ours, theirs in names.items()}
        (field,), (key,) = self.ours, self.theirs

        def import_(data: Mapping[str, Any]) -> dict[str, Any]:
            name = data.get(key, self.default)
            if (value := ours_of.get(aliases.get(name, name))) is None:
                raise ConversionError(f"`{key}` = {name!r} is not supported (blockzoo has {', '.join(names.values())})")
            return {field: value}

        def export(config: Any) -> dict[str, Any]:
            value = get_path(config, field)
            if value not in names:
                raise ConversionError(f"`{field}` = {value!r} cannot be written: the format names {', '.join(names)}")
            return {key: names[value]}

        return Computed(self.ours, self.theirs, import_=import_, export=export)

    def import_values(self, data: Mapping[str, Any]) -> dict[str, Any]:
        raise ConversionError(f"`{self.theirs[0]}` is named by the format: convert through its format (for_format)")

    def export_values(self, config: Config) -> dict[str, Any]:
        raise ConversionError(f"`{self.ours[0]}` is named by the format: convert through its format (for_format)")


def format_activation(theirs: str = "hidden_act") -> FormatNames:
    """The `activation` field <-> the activation's name in the format's config (`hidden_act`; absent: silu), as the
    format names activations (`value_names("activation")`: each format keeps its own table)."""
    return FormatNames("activation", theirs, "activation", default="silu")


transformers_activation = format_activation  # its former name, which plugins written for plugin API 1.2 import


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


def join(prefix: str, name: str) -> str:
    """`prefix.name`, either part maybe empty."""
    return f"{prefix}.{name}" if prefix and name else prefix or name


def get_path(config: Any, path: str) -> Any:
    """The value of a dotted field path of a config."""
    value = config
    for step in path.split("."):
        value = getattr(value, step)
    return value
