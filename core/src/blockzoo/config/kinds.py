"""The glue between configs and the plugin registry: resolving a polymorphic section's `type` to a registered
config class. The registry (`blockzoo.plugins.get_registry`) installs itself here when imported, so this package
imports nothing of it: no import cycle."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from blockzoo.config.classes import PolymorphicConfig
from blockzoo.config.errors import UnknownTypeError
from blockzoo.config.values import _describe

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
