"""The config machinery: frozen attrs classes, one cattrs converter, errors that name the field.

Every config is an attrs class decorated with `@configclass` (frozen, keyword-only). Polymorphic
configs (mixer, MLP, block, ...) subclass a *kind* base that declares `kind` and `default_type`;
their concrete classes are registered by plugins, and the `type` key of a mapping is resolved
through the plugin registry at structure time, so plugins loaded after the core work too.

This module imports no torch: configs must stay cheap to load (CLI, `blockzoo plugins`).
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import functools
import math
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import attrs
import cattrs
import cattrs.gen
import yaml
from cattrs.errors import (
    AttributeValidationNote,
    BaseValidationError,
    ForbiddenExtraKeysError,
    IterableValidationNote,
)

from blockzoo.errors import PluginError

ConfigT = TypeVar("ConfigT", bound="Config")


class Config:
    """Base class of every config. Instances remember which fields were given explicitly."""

    def explicit_fields(self) -> frozenset[str]:
        """Fields set by the user. Configs built in Python count fields that differ from the default."""
        given = self.__dict__.get("_explicit_fields")
        if given is not None:
            return given
        return frozenset(
            field.name
            for field in attrs.fields(type(self))
            if not _equals_default(field, getattr(self, field.name), self)
        )


class PolymorphicConfig(Config):
    """Base of a config kind whose concrete class is chosen by a `type` key.

    A kind base sets `kind` (the registry's key, e.g. "mixer") and `default_type` (the type used when
    the key is absent; None if the key is required).
    """

    kind: ClassVar[str]
    default_type: ClassVar[str | None] = None


def configclass(cls: type[ConfigT]) -> type[ConfigT]:
    """Make `cls` a frozen, keyword-only attrs config class whose constructor checks each value's type as reading
    a YAML file does (`ModelConfig(hidden_size="abc")` names the field), before the field's own validators."""
    return attrs.frozen(kw_only=True, field_transformer=_with_type_checks)(cls)


def _with_type_checks(cls: type, fields: list[attrs.Attribute]) -> list[attrs.Attribute]:
    return [
        field.evolve(validator=attrs.validators.and_(_check_type, *([field.validator] if field.validator else [])))
        for field in fields
    ]


def _check_type(instance: Config, attribute: attrs.Attribute, value: Any) -> None:
    """The value a constructor got must be one that structuring plain data would have made: the same value of an
    accepted type (an int for a float, a tuple for a list...), never plain data of a config (a dict for a config)."""
    annotation = _field_types(type(instance)).get(attribute.name)
    if annotation is None:
        return
    token = _allow_infinite.set(bool(attribute.metadata.get("infinite")))
    try:
        structured = converter.structure(value, annotation)
    except Exception as error:  # noqa: BLE001 - reported as the field's problem
        problems = list(_collect_errors(error, []))
        message = "; ".join(f"{path}: {problem}" if path else problem for path, problem in problems) or str(error)
        raise ConfigFieldError(attribute.name, message) from None
    finally:
        _allow_infinite.reset(token)
    if not _same(structured, value):
        names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list"}
        expected = names.get(type(structured), f"a {type(structured).__name__}")
        raise ConfigFieldError(attribute.name, f"expected {expected}, got {_describe(value)}")


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """The resolved annotations of a config class's fields (none when they cannot be resolved: nothing is checked)."""
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - a class whose annotations name what its module does not import
        return {}


def _same(structured: Any, given: Any) -> bool:
    """Whether structuring kept `given` (a sequence may change from list to tuple, a number from int to float)."""
    if isinstance(given, Config) or isinstance(structured, Config):
        return structured is given
    if isinstance(given, (list, tuple)) and isinstance(structured, (list, tuple)):
        return len(given) == len(structured) and all(map(_same, structured, given))
    if isinstance(given, Mapping) and isinstance(structured, Mapping):
        return given.keys() == structured.keys() and all(_same(structured[key], given[key]) for key in given)
    if isinstance(structured, Path):
        return structured == Path(given)
    widened = type(structured) is float and type(given) is int  # an int where a number is asked for
    return structured == given and (type(structured) is type(given) or widened)


def field(
    default: Any = attrs.NOTHING, *, doc: str = "", factory: Any = None, validator: Any = None, infinite: bool = False
) -> Any:
    """An attrs field with a doc string, used by the config reference.

    Numbers in a config are finite: `infinite=True` lets this field's floats be `.inf` / `-.inf` (say what it means
    in `doc`); NaN is refused everywhere."""
    metadata = {"doc": doc, "infinite": infinite}
    if factory is not None:
        return attrs.field(factory=factory, validator=validator, metadata=metadata)
    return attrs.field(default=default, validator=validator, metadata=metadata)


# ---------------------------------------------------------------------------------------------------------------------
# Errors


class ConfigError(ValueError):
    """A config could not be read. `errors` holds (path, message) pairs, one per problem."""

    def __init__(self, errors: list[tuple[str, str]], source: str | None = None):
        self.errors = errors
        self.source = source
        where = f" ({source})" if source else ""
        lines = [f"invalid config{where}:"] + [f"  {path or '<root>'}: {message}" for path, message in errors]
        super().__init__("\n".join(lines))


class ConfigFieldError(ValueError):
    """Raised by a config's own validation; the path of the offending field is completed by the caller."""

    def __init__(self, field_name: str, message: str):
        self.field_name = field_name
        self.message = message
        super().__init__(f"{field_name}: {message}")


class UnknownTypeError(ValueError):
    """The `type` key of a polymorphic config names no registered type."""


def check(condition: bool, field_name: str, message: str) -> None:
    """For `__attrs_post_init__` validations: raise a field error unless `condition` holds."""
    if not condition:
        raise ConfigFieldError(field_name, message)


def at_least(minimum: float) -> Any:
    """attrs validator: the value (when not None) is >= minimum."""

    def validate(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and value < minimum:
            raise ConfigFieldError(attribute.name, f"must be >= {minimum}, got {value!r}")

    return validate


def at_most(maximum: float) -> Any:
    """attrs validator: the value (when not None) is <= maximum."""

    def validate(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and value > maximum:
            raise ConfigFieldError(attribute.name, f"must be <= {maximum}, got {value!r}")

    return validate


def greater_than(minimum: float) -> Any:
    """attrs validator: the value (when not None) is > minimum."""

    def validate(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and value <= minimum:
            raise ConfigFieldError(attribute.name, f"must be > {minimum}, got {value!r}")

    return validate


# ---------------------------------------------------------------------------------------------------------------------
# Structuring


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    return f"{value!r} ({type(value).__name__})"


# Integers are 64-bit, what torch indexes with: a larger value cannot be a size, a count or a seed.
INT_MAX = 2**63 - 1
INT_MIN = -(2**63)
# A float is taken as an int only when it is a whole number that a float holds exactly (4.0, not 2.5 or 1e30).
_EXACT_FLOAT_INT = 2**53

# Set while the floats of a field declared `infinite=True` are structured.
_allow_infinite: contextvars.ContextVar[bool] = contextvars.ContextVar("allow_infinite", default=False)


def _short(value: int) -> str:
    text = str(value)
    return text if len(text) <= 30 else f"a {len(text.lstrip('-'))}-digit integer"


def _structure_int(value: Any, _: type) -> int:
    if isinstance(value, float) and value.is_integer() and abs(value) <= _EXACT_FLOAT_INT:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {_describe(value)}")
    if not INT_MIN <= value <= INT_MAX:
        raise ValueError(f"{_short(value)} does not fit in 64 bits: integers must be between {INT_MIN} and {INT_MAX}")
    return value


def _structure_float(value: Any, _: type) -> float:
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:
            raise ValueError(f"{_short(value)} is too large for a number") from None
    elif isinstance(value, str):
        # YAML 1.1 reads `1e-5` (no dot) as a string; accept numeric strings for float fields.
        with contextlib.suppress(ValueError):
            number = float(value)
    if number is None:
        raise ValueError(f"expected a number, got {_describe(value)}")
    if math.isnan(number):
        raise ValueError(f"expected a number, got {value!r} (not a number)")
    if math.isinf(number) and not _allow_infinite.get():
        raise ValueError(f"expected a finite number, got {value!r}")
    return number


def _structure_bool(value: Any, _: type) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {_describe(value)}")
    return value


def _structure_str(value: Any, _: type) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {_describe(value)}")
    return value


def _key_problem(key: Any) -> str:
    """Why a mapping key that is not a string is refused (YAML 1.1 reads unquoted `on`, `no`, `1` as bool or int)."""
    message = f"the key {_describe(key)} is not a string"
    if key is None:
        return f"{message}: YAML reads an unquoted null or ~ as null; quote the key"
    if isinstance(key, bool):
        spelled, example = ("on/yes/true", "on") if key else ("off/no/false", "off")
        return f"{message}: YAML reads an unquoted {spelled} as {str(key).lower()}; quote the key (e.g. '{example}')"
    return f"{message}; quote it in YAML ('{key}')"


def _noun(annotation: Any) -> str:
    """What a value of `annotation` is, in words, plural (for "a list of ...")."""
    if annotation in (str, Path):
        return "strings"
    if annotation is int:
        return "integers"
    if annotation is float:
        return "numbers"
    if annotation is bool:
        return "booleans (true/false)"
    if _is_literal(annotation):
        return "values among " + ", ".join(repr(choice) for choice in typing.get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, Config):
        return f"{_config_label(annotation).removeprefix('a ')}s (mappings)"
    return "values"


def _structure_items(items: list[tuple[Any, Any, Any]]) -> list[Any]:
    """Structure (step, value, type) triples; every problem reported at its step, all at once."""
    results, problems = [], []
    for step, value, annotation in items:
        try:
            results.append(converter.structure(value, annotation))
        except Exception as error:  # noqa: BLE001 - each reported with its path below
            _reraise_plugin_error(error)
            problems += _collect_errors(error, [str(step)])
    if problems:
        raise ConfigError(problems)
    return results


def _structure_mapping(value: Any, annotation: Any) -> dict:
    key_type, value_type = typing.get_args(annotation) or (Any, Any)
    if not isinstance(value, Mapping):
        raise ValueError(f"expected a mapping of names to {_noun(value_type)}, got {_describe(value)}")
    if key_type is str and (bad := [key for key in value if not isinstance(key, str)]):
        raise ConfigError([(str(key), _key_problem(key)) for key in bad])
    keys = _structure_items([(key, key, key_type) for key in value])
    items = _structure_items([(key, item, value_type) for key, item in value.items()])
    return dict(zip(keys, items))


def _structure_list(value: Any, annotation: Any) -> list:
    (item_type,) = typing.get_args(annotation) or (Any,)
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"expected a list of {_noun(item_type)}, got {_describe(value)}")
    return _structure_items([(index, item, item_type) for index, item in enumerate(value)])


def _structure_tuple(value: Any, annotation: Any) -> tuple:
    item_types = typing.get_args(annotation)
    if len(item_types) == 2 and item_types[1] is Ellipsis:
        return tuple(_structure_list(value, list[item_types[0]]))
    nouns = {_noun(item_type) for item_type in item_types}
    expected = f"a list of {len(item_types)} {nouns.pop() if len(nouns) == 1 else 'values'}"
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"expected {expected}, got {_describe(value)}")
    if len(value) != len(item_types):
        raise ValueError(f"expected {expected}, got {len(value)}: {value!r}")
    return tuple(_structure_items([(index, *pair) for index, pair in enumerate(zip(value, item_types))]))


def _origin_is(*origins: type) -> Any:
    return lambda annotation: typing.get_origin(annotation) in origins or annotation in origins


def _structure_literal(value: Any, literal: Any) -> Any:
    choices = typing.get_args(literal)
    if not any(value == choice and type(value) is type(choice) for choice in choices):
        raise ValueError(f"expected one of {', '.join(repr(c) for c in choices)}; got {value!r}")
    return value


def _is_literal(annotation: Any) -> bool:
    return typing.get_origin(annotation) is Literal


# The registry of type names: `blockzoo.plugins.get_registry`, installed by that module when it is imported (the
# `blockzoo` package imports it first), so this module imports nothing of it: no import cycle.
_type_registry: Callable[[], Any] | None = None


def set_type_registry(provider: Callable[[], Any]) -> None:
    """Install the function returning the registry that resolves polymorphic `type` names (`blockzoo.plugins`)."""
    global _type_registry
    _type_registry = provider


def _registry() -> Any:
    if _type_registry is None:
        raise RuntimeError("no registry of config types: import blockzoo.plugins first")
    return _type_registry()


def _structure_hook_factory(cls: type[Config], converter: cattrs.Converter) -> Any:
    overrides = {
        attribute.name: cattrs.gen.override(struct_hook=_structure_infinite)
        for attribute in attrs.fields(cls)
        if attribute.metadata.get("infinite")
    }
    structure_fields = cattrs.gen.make_dict_structure_fn(cls, converter, **overrides)
    polymorphic = issubclass(cls, PolymorphicConfig)

    def structure(data: Any, _: type) -> Config:
        if isinstance(data, cls):
            return data
        if not isinstance(data, Mapping):
            raise ValueError(f"expected a mapping for {_config_label(cls)}, got {_describe(data)}")
        if bad := [key for key in data if not isinstance(key, str)]:
            raise ConfigError([(str(key), _key_problem(key)) for key in bad])
        if polymorphic:
            target = _resolve_type(cls, data.get("type"))
            if target is not cls:
                if "type" in data:
                    return converter.structure(data, target)
                return _structure_assumed(data, cls, target)
            data = {key: value for key, value in data.items() if key != "type"}
        given = frozenset(data)
        if (complete := getattr(cls, "complete_data", None)) is not None:
            data = complete(data)
        instance = structure_fields(data, cls)
        object.__setattr__(instance, "_explicit_fields", given)
        return instance

    return structure


def _structure_assumed(data: Mapping, annotated: type[PolymorphicConfig], target: type) -> Config:
    """Structure a section with no `type` as the kind's default type; its problems say that default was assumed (a
    section meant as another type, e.g. a partial override, otherwise reads as nonsense)."""
    try:
        return converter.structure(data, target)
    except Exception as error:  # noqa: BLE001 - every problem reported, with the default named
        _reraise_plugin_error(error)
        assumed = f" (no `type` given: the default {annotated.kind} type {annotated.default_type!r} was assumed)"
        # Keys of this very section that the default type has not, or needs: another type may have been meant.
        suspect = ("unknown key", "missing required")
        problems = [
            (path, message + assumed if "." not in path and message.startswith(suspect) else message)
            for path, message in _collect_errors(error, [])
        ]
        raise ConfigError(problems) from None


def _structure_infinite(value: Any, annotation: Any) -> Any:
    token = _allow_infinite.set(True)
    try:
        return converter.structure(value, annotation)
    finally:
        _allow_infinite.reset(token)


def _config_label(cls: type) -> str:
    return f"a {cls.kind} config" if issubclass(cls, PolymorphicConfig) else cls.__name__


def _resolve_type(annotated: type[PolymorphicConfig], name: Any) -> type[PolymorphicConfig]:
    registry = _registry()
    kind = annotated.kind
    if name is None:
        if registry.is_registered(annotated):
            return annotated
        if annotated.default_type is None:
            raise UnknownTypeError(
                f"a `type` is required for this {kind}; available: {registry.describe_available(kind)}"
            )
        try:
            return registry.resolve(kind, annotated.default_type).config_class
        except UnknownTypeError as error:
            raise UnknownTypeError(f"no `type` given, and the default {kind} type is not available: {error}") from None
    if not isinstance(name, str):
        raise UnknownTypeError(f"expected a {kind} type name, got {_describe(name)}")
    target = registry.resolve(kind, name).config_class
    if not issubclass(target, annotated):
        raise UnknownTypeError(
            f"{kind} type {name!r} is a {target.__name__}, but a {annotated.__name__} is expected here"
        )
    return target


def _make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    converter.register_structure_hook(int, _structure_int)
    converter.register_structure_hook(float, _structure_float)
    converter.register_structure_hook(bool, _structure_bool)
    converter.register_structure_hook(str, _structure_str)
    converter.register_structure_hook(Path, lambda value, _: Path(_structure_str(value, str)))
    converter.register_structure_hook_func(_is_literal, _structure_literal)
    # Containers check their own type first, so a wrong one says what was expected (not "'int' has no attribute").
    converter.register_structure_hook_func(_origin_is(dict, Mapping), _structure_mapping)
    converter.register_structure_hook_func(_origin_is(list, Sequence), _structure_list)
    converter.register_structure_hook_func(_origin_is(tuple), _structure_tuple)
    converter.register_structure_hook_factory(
        lambda cls: isinstance(cls, type) and issubclass(cls, Config) and attrs.has(cls),
        lambda cls: _structure_hook_factory(cls, converter),
    )
    converter.register_unstructure_hook_func(
        lambda cls: isinstance(cls, type) and issubclass(cls, Config), lambda value: to_dict(value)
    )
    return converter


converter = _make_converter()


def structure(data: Any, cls: type[ConfigT], *, source: str | None = None, root: str = "") -> ConfigT:
    """Build a config of class `cls` from plain data (a mapping), or raise ConfigError listing every problem."""
    try:
        return converter.structure(data, cls)
    except Exception as error:
        _reraise_plugin_error(error)
        problems = list(_collect_errors(error, [root] if root else []))
        raise ConfigError(problems, source) from error


def _reraise_plugin_error(error: BaseException) -> None:
    """A plugin that did not load (strict mode) is not a problem of this config: raise it as it is."""
    if plugin_error := _find(error, PluginError):
        raise plugin_error from None


def _find(error: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first exception of `kind` in `error`, searching inside exception groups."""
    if isinstance(error, kind):
        return error
    for sub_error in getattr(error, "exceptions", ()):
        if found := _find(sub_error, kind):
            return found
    return None


def _collect_errors(error: BaseException, path: list[str]) -> typing.Iterator[tuple[str, str]]:
    if isinstance(error, BaseValidationError):
        for sub_error in error.exceptions:
            step = None
            for note in getattr(sub_error, "__notes__", ()):
                if isinstance(note, AttributeValidationNote):
                    step = note.name
                elif isinstance(note, IterableValidationNote):
                    step = str(note.index)
            if isinstance(sub_error, KeyError) and step is not None:
                yield _join([*path, step]), "missing required field"
            else:
                yield from _collect_errors(sub_error, path + ([step] if step is not None else []))
    elif isinstance(error, ForbiddenExtraKeysError):
        known = [f.name for f in attrs.fields(error.cl)]
        if issubclass(error.cl, PolymorphicConfig):
            known = ["type", *known]
        for key in sorted(error.extra_fields, key=str):
            hint = difflib.get_close_matches(key, known, n=1) if isinstance(key, str) else []
            suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
            yield _join([*path, key]), f"unknown key{suggestion} (valid keys: {', '.join(known)})"
    elif isinstance(error, ConfigFieldError):
        yield _join([*path, error.field_name]), error.message
    elif isinstance(error, UnknownTypeError):
        yield _join([*path, "type"]), str(error)
    elif isinstance(error, ConfigError):
        for sub_path, message in error.errors:
            yield _join(path + ([sub_path] if sub_path else [])), message
    else:
        yield _join(path), str(error) or type(error).__name__


def _join(path: list[str]) -> str:
    return ".".join(step for step in path if step)


# ---------------------------------------------------------------------------------------------------------------------
# Unstructuring


def to_dict(config: Config, *, explicit_only: bool = False) -> dict[str, Any]:
    """Plain data for `config`. With `explicit_only`, only the fields the user set (the config as an update).

    Polymorphic configs always carry their `type`, so the data structures back to the same classes.
    """
    data: dict[str, Any] = {}
    if isinstance(config, PolymorphicConfig):
        data["type"] = _registry().name_of(type(config))
    explicit = config.explicit_fields() if explicit_only else None
    for attribute in attrs.fields(type(config)):
        if explicit is not None and attribute.name not in explicit:
            continue
        data[attribute.name] = _plain(getattr(config, attribute.name), explicit_only)
    return data


def _plain(value: Any, explicit_only: bool) -> Any:
    if isinstance(value, Config):
        return to_dict(value, explicit_only=explicit_only)
    if isinstance(value, Mapping):
        return {key: _plain(item, explicit_only) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item, explicit_only) for item in value]
    if isinstance(value, Path):
        return str(value)
    return value


def _equals_default(attribute: attrs.Attribute, value: Any, instance: Any) -> bool:
    default = attribute.default
    if default is attrs.NOTHING:
        return False
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        try:
            default = default.factory(instance) if default.takes_self else default.factory()
        except ConfigError:  # The default cannot be built here (e.g. its plugin is missing): the value was given.
            return False
    if isinstance(value, float) and isinstance(default, float) and math.isnan(value) and math.isnan(default):
        return True
    return value == default and type(value) is type(default)


# ---------------------------------------------------------------------------------------------------------------------
# Updates: YAML files, `key.path=value` overrides, merging an update into a config


def merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge `update` into `base`. A node whose `type` changes is replaced, not merged."""
    if "type" in update and "type" in base and update["type"] != base["type"]:
        return dict(update)
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def update(config: ConfigT, changes: Mapping[str, Any], *, source: str | None = None) -> ConfigT:
    """A new config: `config`'s explicit fields with `changes` merged over them. Defaults are re-derived. A part
    whose `type` the changes replace keeps its explicit fields that the new type also has (`data.type=memmap`
    keeps the `sequence_length` the file set for its embedded data); the new type's defaults fill the rest."""
    changes = _carry_over(config, changes)
    return structure(merge(to_dict(config, explicit_only=True), changes), type(config), source=source)


def _carry_over(config: Any, changes: Any) -> Any:
    """`changes`, where one gives a part another `type`, completed with the part's explicit fields that the new type
    also has (the changes' own values first). A type that does not resolve is left for `structure` to report."""
    if not isinstance(changes, Mapping):
        return changes
    if isinstance(config, PolymorphicConfig) and "type" in changes:
        try:
            target = _registry().resolve(config.kind, changes["type"]).config_class
        except Exception:  # noqa: BLE001 - an unknown or malformed type: structure names it at its field
            return changes
        if target is not type(config):
            fields = attrs.fields_dict(target)
            kept = {key: value for key, value in to_dict(config, explicit_only=True).items() if key in fields}
            return {**kept, **changes}
    if isinstance(config, Config):
        return {key: _carry_over(getattr(config, key, None), value) for key, value in changes.items()}
    if isinstance(config, Mapping):  # a mapping of names to configs (a pattern's blocks)
        return {key: _carry_over(config.get(key), value) for key, value in changes.items()}
    return changes


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """Turn `["model.hidden_size=512", ...]` into a nested update. Values are parsed as YAML (typed)."""
    result: dict[str, Any] = {}
    problems = []
    for override in overrides:
        key, separator, raw_value = override.partition("=")
        steps = key.strip().split(".")
        if not separator or not all(steps):
            problems.append((override, "an override must look like `path.to.key=value`"))
            continue
        try:
            value = yaml.safe_load(raw_value)
        except yaml.YAMLError as error:
            problems.append((key, f"cannot parse value {raw_value!r}: {_yaml_problem(error)}"))
            continue
        node = result
        for step in steps[:-1]:
            child = node.setdefault(step, {})
            if not isinstance(child, dict):
                problems.append((key, f"conflicts with the override of {step!r}"))
                break
            node = child
        else:
            node[steps[-1]] = value
    if problems:
        raise ConfigError(problems, "command line")
    return result


def _yaml_problem(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    if mark is not None:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return problem


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping, with errors that give the file, line and column."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError([("", f"cannot read the file: {error.strerror or error}")], str(path)) from error
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError([("", f"malformed YAML at {_yaml_problem(error)}")], str(path)) from error
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([("", f"the file must hold a mapping of keys, found {type(data).__name__}")], str(path))
    return data


def to_yaml(config: Config, *, explicit_only: bool = False) -> str:
    return yaml.safe_dump(to_dict(config, explicit_only=explicit_only), sort_keys=False)


def load(
    cls: type[ConfigT], path: str | Path | None = None, overrides: Sequence[str] = (), *, data: Mapping | None = None
) -> ConfigT:
    """Read a config: a YAML file (or `data`) with `key=value` overrides applied on top."""
    base = read_yaml(path) if path is not None else dict(data or {})
    source = str(path) if path is not None else None
    changes = parse_overrides(overrides)
    try:
        config = structure(base, cls, source=source)
    except ConfigError:
        if not changes:
            raise
        # The overrides may complete an incomplete file.
        return structure(merge(base, changes), cls, source=f"{source} with overrides" if source else "overrides")
    # Applied as an update, so an override of a `type` starts that part from the new type's defaults.
    return update(config, changes, source="command line") if changes else config
