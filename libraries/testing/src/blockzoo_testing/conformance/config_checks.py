"""The checks of a layer plugin's discovery and config: registered through its entry point, plain data round trips,
unknown keys refused, every field documented and changing the layer, config and hook modules free of torch."""

from __future__ import annotations

import importlib.metadata
import math
import os
import subprocess
import sys
import typing
from collections.abc import Mapping
from types import UnionType
from typing import Any, Literal

import attrs
import yaml

from blockzoo.config import Config, ConfigError, PolymorphicConfig, merge, structure, to_dict
from blockzoo.plugins import ENTRY_POINT_GROUP, get_registry
from blockzoo_testing.conformance.base import ConformanceBase, _fail
from blockzoo_testing.layers import LayerSignature


class ConfigChecks(ConformanceBase):
    """The conformance kit's checks of a layer plugin's discovery and config."""

    # -- discovery and config ----------------------------------------------------------------------------------------

    def test_discovered_through_its_entry_point(self) -> None:
        entry = self._entry()
        record = entry.plugin
        if record.distribution is None:
            _fail(
                f"{self.kind} type {entry.name!r} is registered by plugin {record.name!r}, which no installed "
                f"distribution provides (it was registered in-process). Install your distribution (`pip install -e .`) "
                f'with the entry point `[project.entry-points."{ENTRY_POINT_GROUP}"] {record.name} = '
                '"<package>.plugin"` in its pyproject.toml.'
            )
        declared = [
            entry_point
            for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP, name=record.name)
            if entry_point.dist is not None and entry_point.dist.name == record.distribution
        ]
        if not declared:
            _fail(
                f"{record.distribution} registers {entry.name!r} but declares no {ENTRY_POINT_GROUP!r} entry point "
                f"named {record.name!r}; reinstall it after fixing its pyproject.toml"
            )
        if record.conflicts:
            _fail(f"plugin {record.label} conflicts with another plugin over {', '.join(record.conflicts)}: rename")
        implementation = self._implementation(entry)
        if not (isinstance(implementation, type) and issubclass(implementation, self.layer_base)):
            _fail(
                f"the implementation {entry.implementation!r} of {entry.name!r} is {implementation!r}; it must be a "
                f"subclass of blockzoo.api.{self.layer_base.__name__}, built as Impl(config, *, name, hidden_dim, "
                "distributed, lr_scale)"
            )
        if record.info is None:
            _fail(
                f"plugin {record.label} has no plugin_info hook: add `@hookimpl def plugin_info(): return "
                "PluginInfo(capabilities=..., description=...)` to its hook module (it reports the plugin API version "
                "it was written for)"
            )
        missing = sorted(entry.config_class.capabilities - set(record.info.capabilities))
        if missing:
            _fail(
                f"{entry.config_class.__name__} declares {', '.join(missing)} but plugin_info().capabilities of "
                f"{record.label} does not list it; `blockzoo plugins` shows plugin_info's list: return "
                f"PluginInfo(capabilities=tuple(sorted({entry.config_class.__name__}.capabilities)), ...)"
            )

    def test_config_round_trip(self) -> None:
        config = self._config()
        data = to_dict(config)
        again = self._structure(data, "the data of to_dict(config)")
        if again != config:
            _fail(
                f"structure(to_dict(config)) differs from config:\n  {again!r}\n  {config!r}\n"
                "Every field must survive plain data: use blockzoo field types (int, float, bool, str, Literal, "
                "configs, lists, dicts) and no state outside the attrs fields."
            )
        if yaml.safe_load(yaml.safe_dump(data)) != data:
            _fail(f"to_dict(config) does not survive YAML (checkpoints store config.yaml): {data!r}")
        explicit = self._structure(to_dict(config, explicit_only=True), "to_dict(config, explicit_only=True)")
        if explicit != config:
            _fail(f"the explicit fields alone do not give the config back:\n  {explicit!r}\n  {config!r}")
        self._structure({"type": self._entry().name}, "the default config (`blockzoo plugins --check` builds it)")

    def test_unknown_keys_are_rejected(self) -> None:
        data = {**self._data(), "no_such_field": 1}
        try:
            structure(data, self.kind_config)
        except ConfigError as error:
            if not any(path == "no_such_field" and "unknown key" in message for path, message in error.errors):
                _fail(f"an unknown key was refused, but not by name: {error}")
            return
        _fail(
            "a config with an unknown key `no_such_field` was accepted: declare the config class with "
            "blockzoo.api.configclass and its fields with blockzoo.api.field (blockzoo's converter refuses unknown "
            "keys)"
        )

    def test_every_field_is_documented(self) -> None:
        config_class = type(self._config())
        undocumented = [f.name for f in attrs.fields(config_class) if not f.metadata.get("doc")]
        if undocumented:
            _fail(
                f"fields of {config_class.__name__} without a doc: {', '.join(undocumented)}. Declare each with "
                '`field(default, doc="...")`: `blockzoo config schema` prints the doc in the config reference.'
            )

    def test_config_and_hook_modules_import_no_torch(self) -> None:
        entry = self._entry()
        modules = [entry.config_class.__module__]
        if entry.plugin.module is not None and hasattr(entry.plugin.module, "__name__"):
            modules.append(entry.plugin.module.__name__)
        script = (
            "import importlib, sys\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            "    if 'torch' in sys.modules:\n"
            "        raise SystemExit(f'importing {name} imported torch')\n"
        )
        # The modules this process can import (an uninstalled src layout, a test directory) are importable there too.
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
        result = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=environment
        )
        if result.returncode:
            _fail(
                f"{result.stderr.strip().splitlines()[-1] if result.stderr.strip() else 'failed'}. A plugin's config "
                "and hook modules must not import torch: blockzoo imports them to list plugins and validate configs. "
                "Import torch only in the layer module that the 'module:Class' implementation string names."
            )

    def test_every_field_changes_something(self) -> None:
        config_class = type(self._config())
        names = {f.name for f in attrs.fields(config_class)}
        for option in ("field_exceptions", "field_changes"):
            unknown = set(getattr(self, option)) - names
            if unknown:
                _fail(f"{option} names {', '.join(sorted(unknown))}, not fields of {config_class.__name__}")
        empty = [name for name, reason in self.field_exceptions.items() if not str(reason).strip()]
        if empty:
            _fail(f"field_exceptions needs a reason for {', '.join(empty)}")
        base = self._signature(self._config())
        if self._signature(self._config()).differs_from(base, self.tolerance):
            _fail(
                "two builds of the same config differ: initialize only through create_parameter (seeded by the run's "
                "seed and the parameter's name) and draw randomness in forward only from torch's seeded generators"
            )
        attrs.resolve_types(config_class)
        problems = []
        for attribute in attrs.fields(config_class):
            if attribute.name in self.field_exceptions:
                continue
            if attribute.name in self.field_changes:
                changes = [self.field_changes[attribute.name]]
            else:
                value = getattr(self._config(), attribute.name)
                changes = [{attribute.name: change} for change in _candidate_changes(attribute.type, value)]
            if not changes:
                problems.append(
                    f"{attribute.name}: the kit cannot derive a change for a field of type {attribute.type}; give one "
                    f'in field_changes = {{"{attribute.name}": {{"{attribute.name}": ...}}}}'
                )
                continue
            outcome = self._first_change_that_shows(changes, base)
            if outcome is not None:
                problems.append(f"{attribute.name}: {outcome}")
        if problems:
            _fail(
                f"these fields of {config_class.__name__} changed neither the parameters nor the output:\n"
                + "\n".join(f"  - {problem}" for problem in problems)
                + "\nEvery declared field must change the layer. Use the field, or remove it; a field that acts only "
                "where one process cannot show it goes in `field_exceptions = {name: reason}`; a change that needs "
                "other fields goes in `field_changes = {name: {...}}`."
            )

    def _first_change_that_shows(self, changes: list[Mapping[str, Any]], base: LayerSignature) -> str | None:
        """None when one of `changes` changes the layer, else what was tried."""
        tried = []
        for change in changes:
            try:
                config = structure(merge(self._data(), change), self.kind_config)
            except ConfigError as error:
                tried.append(f"{_show(change)} is refused ({'; '.join(message for _, message in error.errors)})")
                continue
            try:
                signature = self._signature(config)
            except Exception as error:  # noqa: BLE001 - a change this process cannot run shows nothing here
                tried.append(f"{_show(change)} does not run here ({type(error).__name__}: {error})")
                continue
            if signature.differs_from(base, self.tolerance):
                return None
            tried.append(f"{_show(change)} changed nothing")
        shown = 3
        more = f"; and {len(tried) - shown} more changes" if len(tried) > shown else ""
        return "; ".join(tried[:shown]) + more


# ---------------------------------------------------------------------------------------------------------------------
# Deriving a change of each config field from its type


def _candidate_changes(annotation: Any, value: Any, depth: int = 0) -> list[Any]:
    """Values (plain data, merged into the config's data) that differ from `value`, most telling first."""
    origin, arguments = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union or origin is UnionType:
        members = [member for member in arguments if member is not type(None)]
        found = [None] if value is not None and len(members) < len(arguments) else []
        for member in members:
            found += _candidate_changes(member, value, depth)
        return _unique(found)
    if origin is Literal:
        return [choice for choice in arguments if choice != value]
    if annotation is bool:
        return [True, False] if value is None else [not value]
    if annotation is int:
        options = [1, 2, 3, 4, 8] if value is None else [2 * value, value + 1, value - 1, 1, 2, 3]
        return [option for option in _unique(options) if option != value]
    if annotation is float:
        if value is None or value == 0:
            options = [0.5, 0.1, 2.0, 1.0]
        elif math.isinf(value):
            options = [1.0, 10.0]
        else:
            options = [2 * value, 0.5 * value, value + 1.0, 0.5, 0.1]
        return [option for option in _unique(options) if option != value]
    if isinstance(annotation, type) and issubclass(annotation, Config) and attrs.has(annotation):
        return _config_changes(annotation, value, depth)
    return []


def _config_changes(annotation: type[Config], value: Any, depth: int) -> list[Any]:
    found: list[Any] = []
    if value is None:
        found.append({})  # The field's defaults (a polymorphic kind's default type).
    if issubclass(annotation, PolymorphicConfig) and hasattr(annotation, "kind"):
        registry = get_registry(strict=False)
        current = registry.name_of(type(value)) if value is not None and registry.is_registered(type(value)) else None
        found += [
            {"type": entry.name}
            for entry in registry.entries(annotation.kind)
            if entry.name != current and issubclass(entry.config_class, annotation)
        ]
    if value is not None and depth < 2:
        nested_class = type(value)
        attrs.resolve_types(nested_class)
        for attribute in attrs.fields(nested_class):
            for change in _candidate_changes(attribute.type, getattr(value, attribute.name), depth + 1):
                found.append({attribute.name: change})
    return found


def _unique(values: list[Any]) -> list[Any]:
    unique: list[Any] = []
    for value in values:
        if not any(value == seen and type(value) is type(seen) for seen in unique):
            unique.append(value)
    return unique


def _show(change: Mapping[str, Any]) -> str:
    return yaml.safe_dump(dict(change), default_flow_style=True, width=1000).strip()
