"""Configs back to plain data (`to_dict`): polymorphic configs carry their `type`; `explicit_only` keeps only
what the user set (the config as an update)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from blockzoo.config.classes import Config, PolymorphicConfig
from blockzoo.config.errors import ConfigError
from blockzoo.config.kinds import _registry


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
