"""Finding the installed plugins: the entry points of `blockzoo.plugins`, sorted so every rank and test worker
builds the same registry, filtered by BLOCKZOO_PLUGINS / BLOCKZOO_DISABLE_PLUGINS and the version handshake, each
imported on its own (one that fails is recorded with its error, the others load)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from packaging.utils import canonicalize_name

from blockzoo.errors import PluginError
from blockzoo.plugins.compatibility import requirement_problem
from blockzoo.plugins.hookspecs import CORE_PLUGIN, ENTRY_POINT_GROUP
from blockzoo.plugins.registry import PluginRecord, Registry, describe_error, traceback_text, unique_key


def discover(environ: Mapping[str, str] | None = None) -> Registry:
    """Build a registry from the installed entry points, honouring the BLOCKZOO_* variables."""
    environ = os.environ if environ is None else environ
    allowed = _names_from_environment("BLOCKZOO_PLUGINS", environ)
    disabled = _names_from_environment("BLOCKZOO_DISABLE_PLUGINS", environ) or set()
    if CORE_PLUGIN in disabled:
        raise PluginError(
            f"BLOCKZOO_DISABLE_PLUGINS names {CORE_PLUGIN!r}, the core's own plugin, which cannot be disabled"
        )
    registry = Registry()
    for entry_point in _sorted_entry_points(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)):
        distribution = entry_point.dist
        record = PluginRecord(
            name=entry_point.name,
            distribution=distribution.name if distribution else None,
            version=distribution.version if distribution else None,
            location=_location(entry_point),
        )
        if entry_point.name != CORE_PLUGIN and _named(record, disabled):
            record.status, record.error = "disabled", "BLOCKZOO_DISABLE_PLUGINS"
        elif entry_point.name != CORE_PLUGIN and allowed is not None and not _named(record, allowed):
            record.status, record.error = "disabled", "not in BLOCKZOO_PLUGINS"
        elif distribution is not None and (problem := requirement_problem(distribution)):
            record.status, record.error = "incompatible", problem
        if record.status != "loaded":
            registry.plugins[unique_key(registry.plugins, record.name)] = record
            continue
        try:
            module = entry_point.load()
        except BaseException as error:
            if isinstance(error, KeyboardInterrupt):
                raise
            record.status, record.error = "failed", describe_error(error)
            record.traceback = traceback_text(error)
            registry.plugins[unique_key(registry.plugins, record.name)] = record
            continue
        registry.add_plugin(module, record)
    return registry


def _sorted_entry_points(
    entry_points: Iterable[importlib.metadata.EntryPoint],
) -> list[importlib.metadata.EntryPoint]:
    unique = {}
    for entry_point in entry_points:
        distribution = entry_point.dist.name if entry_point.dist else ""
        unique.setdefault((entry_point.name, canonicalize_name(distribution), entry_point.value), entry_point)
    return [unique[key] for key in sorted(unique)]


def _named(record: PluginRecord, names: set[str]) -> bool:
    """Whether a BLOCKZOO_* list names the plugin: by its name (every distribution of it) or `name:distribution`."""
    return record.name in names or f"{record.name}:{record.distribution}" in names


def _names_from_environment(variable: str, environ: Mapping[str, str]) -> set[str] | None:
    value = environ.get(variable)
    if value is None:
        return None
    return {name.strip() for name in value.split(",") if name.strip()}


def _location(entry_point: importlib.metadata.EntryPoint) -> str | None:
    """The plugin's package directory, found without importing it."""
    top_level = entry_point.module.partition(".")[0]
    try:
        spec = importlib.util.find_spec(top_level)
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin is None:
        return None
    origin = Path(spec.origin)
    return str(origin.parent if origin.name == "__init__.py" else origin)
