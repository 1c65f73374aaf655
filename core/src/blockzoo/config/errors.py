"""Config errors that name the field (`ConfigError`, `ConfigFieldError`, `UnknownTypeError`) and the validators
that raise them (`check`, `at_least`, `at_most`, `greater_than`)."""

from __future__ import annotations

from typing import Any

import attrs


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
