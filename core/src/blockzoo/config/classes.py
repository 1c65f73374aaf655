"""Config classes: the bases (`Config`, `PolymorphicConfig` for a kind chosen by a `type` key), `@configclass`
(frozen, keyword-only, each value type-checked as reading YAML does) and `field` (a field with its doc)."""

from __future__ import annotations

import functools
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import attrs

from blockzoo.config.errors import ConfigFieldError
from blockzoo.config.values import _allow_infinite, _describe

ConfigT = TypeVar("ConfigT", bound="Config")


class Config:
    """Base class of every config. Instances remember which fields were given explicitly."""

    def explicit_fields(self) -> frozenset[str]:
        """Fields set by the user. Configs built in Python count fields that differ from the default."""
        from blockzoo.config.unstructure import _equals_default

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
    from blockzoo.config.converter import _collect_errors, converter  # the converter structures configs: a cycle

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
