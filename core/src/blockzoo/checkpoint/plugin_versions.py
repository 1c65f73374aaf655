"""The plugins a checkpoint needs: recorded when saving (each plugin whose types the config uses), checked to be
installed and loaded when reading."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs

from blockzoo.checkpoint.format import CheckpointError
from blockzoo.config import Config, PolymorphicConfig
from blockzoo.plugins import get_registry


def plugins_used(run_config: Config) -> dict[str, dict[str, Any]]:
    """Every plugin that provides a type the config uses: its distribution, version and those types."""
    registry = get_registry()
    plugins: dict[str, dict[str, Any]] = {}
    for node in _polymorphic_nodes(run_config):
        name = registry.name_of(type(node))
        record = registry.resolve(node.kind, name).plugin
        entry = plugins.setdefault(
            record.name, {"distribution": record.distribution, "version": record.version, "types": []}
        )
        if f"{node.kind}:{name}" not in entry["types"]:
            entry["types"].append(f"{node.kind}:{name}")
    for entry in plugins.values():
        entry["types"].sort()
    return dict(sorted(plugins.items()))


def _polymorphic_nodes(value: Any) -> Iterator[PolymorphicConfig]:
    if isinstance(value, PolymorphicConfig):
        yield value
    if isinstance(value, Config):
        for attribute in attrs.fields(type(value)):
            yield from _polymorphic_nodes(getattr(value, attribute.name))
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _polymorphic_nodes(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _polymorphic_nodes(item)


def check_plugins(path: Path, plugins: Mapping[str, Any]) -> None:
    """Every plugin the checkpoint's config needs is installed and loaded."""
    installed = get_registry().plugins.values()
    records = {record.name: record for record in installed if record.status == "loaded"}
    failed = {record.name: record for record in installed if record.status != "loaded"}
    for name, needed in plugins.items():
        if name in records:
            continue
        needed = needed if isinstance(needed, Mapping) else {}
        described = f"plugin {name!r}"
        if needed.get("distribution"):
            described += f" ({needed['distribution']} {needed.get('version')})"
        types = ", ".join(needed.get("types") or ())
        if name in failed:
            record = failed[name]
            reason = f"is installed but {record.status}: {record.error}"
        else:
            reason = "is not installed"
        raise CheckpointError(path, f"the checkpoint needs {described}, which {reason} (it provides: {types})")
