"""The one cattrs converter: config classes structured from plain data (a polymorphic section through its
`type`), containers checked before their items, and every problem collected with the path of its field
(`structure`)."""

from __future__ import annotations

import difflib
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import cattrs
import cattrs.gen
from cattrs.errors import (
    AttributeValidationNote,
    BaseValidationError,
    ForbiddenExtraKeysError,
    IterableValidationNote,
)

from blockzoo.config.classes import Config, ConfigT, PolymorphicConfig
from blockzoo.config.errors import ConfigError, ConfigFieldError, UnknownTypeError
from blockzoo.config.kinds import _config_label, _resolve_type
from blockzoo.config.unstructure import to_dict
from blockzoo.config.values import (
    _allow_infinite,
    _describe,
    _is_literal,
    _key_problem,
    _origin_is,
    _structure_bool,
    _structure_float,
    _structure_int,
    _structure_literal,
    _structure_str,
)
from blockzoo.errors import PluginError


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
