"""The config machinery: frozen attrs classes, one cattrs converter, errors that name the field.

Every config is an attrs class decorated with `@configclass` (frozen, keyword-only). Polymorphic
configs (mixer, MLP, block, ...) subclass a *kind* base that declares `kind` and `default_type`;
their concrete classes are registered by plugins, and the `type` key of a mapping is resolved
through the plugin registry at structure time, so plugins loaded after the core work too.

One module per job: `classes` (the bases, `configclass`, `field`), `errors` (the errors and validators),
`values` and `converter` (structuring plain data, every problem with its field's path), `kinds` (the registry
glue), `unstructure` (`to_dict`), `loading` (YAML files, overrides, updates). This package imports no torch:
configs must stay cheap to load (CLI, `blockzoo plugins`).
"""

from __future__ import annotations

from blockzoo.config.classes import Config, ConfigT, PolymorphicConfig, configclass, field
from blockzoo.config.converter import converter, structure
from blockzoo.config.errors import (
    ConfigError,
    ConfigFieldError,
    UnknownTypeError,
    at_least,
    at_most,
    check,
    greater_than,
)
from blockzoo.config.kinds import set_type_registry
from blockzoo.config.loading import load, merge, parse_overrides, read_yaml, to_yaml, update
from blockzoo.config.unstructure import to_dict
from blockzoo.config.values import INT_MAX, INT_MIN

__all__ = [
    "INT_MAX",
    "INT_MIN",
    "Config",
    "ConfigError",
    "ConfigFieldError",
    "ConfigT",
    "PolymorphicConfig",
    "UnknownTypeError",
    "at_least",
    "at_most",
    "check",
    "configclass",
    "converter",
    "field",
    "greater_than",
    "load",
    "merge",
    "parse_overrides",
    "read_yaml",
    "set_type_registry",
    "structure",
    "to_dict",
    "to_yaml",
    "update",
]
