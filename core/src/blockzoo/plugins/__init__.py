"""Plugins: the hooks they implement (`hookspecs`), what they registered (`registry`), finding the installed ones
(`discovery`), whether they work with this core (`compatibility`) and which distribution provides what
(`providers`). DESIGN.md "Plugin system".

Plugins are modules of pluggy hook implementations named by entry points of the group `blockzoo.plugins`. Loading
is lazy (the first time a type is looked up) and forgiving: a plugin that fails to import, declares a `blockzoo`
range that excludes this core, or registers badly is recorded with its error and shown where its types are asked
for. `BLOCKZOO_STRICT_PLUGINS=1` turns those into errors.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from blockzoo.config import set_type_registry
from blockzoo.errors import PluginError
from blockzoo.plugins.compatibility import capability_api_problem, undeclared_core
from blockzoo.plugins.discovery import discover
from blockzoo.plugins.hookspecs import (
    CAPABILITY_API,
    CORE_PLUGIN,
    ENTRY_POINT_GROUP,
    PLUGIN_API,
    PROJECT,
    REGISTER_HOOKS,
    HookSpecs,
    PluginInfo,
    hookimpl,
    hookspec,
)
from blockzoo.plugins.providers import FIRST_PARTY_DISTRIBUTIONS, FIRST_PARTY_TYPES
from blockzoo.plugins.registry import ConverterEntry, PluginRecord, Registry, TypeEntry, describe_error

__all__ = [
    "CAPABILITY_API",
    "CORE_PLUGIN",
    "ENTRY_POINT_GROUP",
    "FIRST_PARTY_DISTRIBUTIONS",
    "FIRST_PARTY_TYPES",
    "PLUGIN_API",
    "PROJECT",
    "REGISTER_HOOKS",
    "ConverterEntry",
    "HookSpecs",
    "PluginError",
    "PluginInfo",
    "PluginRecord",
    "Registry",
    "TypeEntry",
    "capability_api_problem",
    "describe_error",
    "discover",
    "get_registry",
    "hookimpl",
    "hookspec",
    "register_plugin",
    "reset_registry",
    "strict_mode",
    "undeclared_core",
]

_registry: Registry | None = None
_lock = threading.Lock()


def strict_mode() -> bool:
    return os.environ.get("BLOCKZOO_STRICT_PLUGINS", "") not in ("", "0")


def get_registry(*, strict: bool | None = None) -> Registry:
    """The process-wide registry, loading the plugins on first use.

    In strict mode (default: BLOCKZOO_STRICT_PLUGINS) a plugin that did not load is an error.
    """
    global _registry
    with _lock:
        if _registry is None:
            _registry = discover()
        registry = _registry
    if (strict_mode() if strict is None else strict) and (problems := registry.problems()):
        raise PluginError(
            "plugins failed to load (BLOCKZOO_STRICT_PLUGINS is set):\n" + "\n".join(f"  {line}" for line in problems)
        )
    return registry


def reset_registry() -> None:
    """Forget the loaded plugins; the next lookup discovers them again (tests, notebooks)."""
    global _registry
    with _lock:
        _registry = None


def register_plugin(module: Any, name: str) -> PluginRecord:
    """Register a plugin that is not installed (a module or object of hook implementations), e.g. in a notebook."""
    record = PluginRecord(name=name)
    get_registry().add_plugin(module, record)
    return record


# Config structuring resolves `type` names through this registry; config.py imports nothing of this package.
set_type_registry(get_registry)
