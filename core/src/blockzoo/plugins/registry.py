"""The type registry: every loaded plugin and the types, converter sections and presets it registered, by kind and
name (DESIGN.md "Plugin system").

pluggy calls each plugin's hooks, one plugin at a time, so that what a plugin registers is staged and committed only
when all its hooks succeeded: a plugin that raises or registers badly is recorded with its error (shown where its
types are asked for) and the others load. Two plugins registering one name conflict: neither is used, both named.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib
import re
import traceback
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import pluggy

from blockzoo import presets
from blockzoo.config import PolymorphicConfig, UnknownTypeError
from blockzoo.plugins.compatibility import api_version_problem, capability_api_problem
from blockzoo.plugins.hookspecs import PROJECT, REGISTER_HOOKS, HookSpecs, PluginInfo
from blockzoo.plugins.providers import is_first_party, type_provider

_OWN_KINDS = {"mixer", "mlp", "block", "block_sequence"}
_NAME = re.compile(r"[a-z][a-z0-9_]*")


@attrs.frozen(kw_only=True)
class TypeEntry:
    kind: str
    name: str
    config_class: type[PolymorphicConfig]
    implementation: str | None
    plugin: PluginRecord

    def load_implementation(self) -> Any:
        """Import the implementation named by `module:attribute` (None when the type has none)."""
        if self.implementation is None:
            return None
        module_name, _, attribute = self.implementation.partition(":")
        target: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
        return target


@attrs.frozen(kw_only=True)
class ConverterEntry:
    format: str
    section: Any
    plugin: PluginRecord


@attrs.define(kw_only=True, eq=False)
class PluginRecord:
    name: str
    distribution: str | None = None
    version: str | None = None
    location: str | None = None
    status: str = "loaded"  # loaded | failed | incompatible | disabled
    error: str | None = None
    traceback: str | None = attrs.field(default=None, repr=False)  # of a failure, for `blockzoo plugins --verbose`
    info: PluginInfo | None = None
    types: dict[str, list[str]] = attrs.field(factory=dict)
    conflicts: list[str] = attrs.field(factory=list)
    module: Any = attrs.field(default=None, repr=False)

    @property
    def label(self) -> str:
        if self.distribution is None:
            return repr(self.name)
        return f"{self.name!r} ({self.distribution} {self.version})"

    @property
    def first_party(self) -> bool:
        return is_first_party(self.distribution)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "location": self.location,
            "status": self.status,
            "error": self.error,
            "api_version": ".".join(map(str, self.info.api_version)) if self.info else None,
            "capabilities": list(self.info.capabilities) if self.info else [],
            "types": self.types,
            "conflicts": self.conflicts,
        }


class Registry:
    """Every loaded plugin and every type it registered, by kind and name."""

    def __init__(self) -> None:
        # pluggy calls the hooks of one plugin at a time: each is registered on this manager while its hooks run
        # (`_alone`), so that what it registers is staged apart and a failure is its own.
        self.plugin_manager = pluggy.PluginManager(PROJECT)
        self.plugin_manager.add_hookspecs(HookSpecs)
        self._loaded: dict[str, Any] = {}  # `name:distribution` -> module of each plugin that did not fail
        self.plugins: dict[str, PluginRecord] = {}
        self.converters: list[ConverterEntry] = []
        self._types: dict[tuple[str, str], TypeEntry] = {}
        self._names: dict[type, str] = {}
        self._conflicts: dict[tuple[str, str], list[TypeEntry]] = {}
        self.presets: dict[str, presets.PresetEntry] = {}
        self.preset_conflicts: dict[str, list[presets.PresetEntry]] = {}

    # -- lookup ------------------------------------------------------------------------------------------------------

    def resolve(self, kind: str, name: str) -> TypeEntry:
        entry = self._types.get((kind, name))
        if entry is not None:
            return entry
        if (kind, name) in self._conflicts:
            raise UnknownTypeError(self._conflict_message(kind, name))
        close = difflib.get_close_matches(name, self.available(kind), n=1)
        suggestion = f"; did you mean {close[0]!r}?" if close else ""
        raise UnknownTypeError(
            f"unknown {kind} type {name!r}{suggestion} (available: {self.describe_available(kind)})"
            f"{self._hint(kind, name)}"
        )

    def _hint(self, kind: str, name: str) -> str:
        plugin_name, dot, _ = name.partition(".")
        if dot:
            candidates = [record for record in self.plugins.values() if record.name == plugin_name]
            if not candidates:
                return f". No installed plugin is named {plugin_name!r}: install the distribution that provides it"
        else:
            distribution = type_provider(kind, name)
            candidates = [record for record in self.plugins.values() if record.distribution == distribution]
            if distribution and not candidates:
                return f". {kind} type {name!r} is provided by {distribution}, which is not installed"
            if not candidates:  # Unknown plain name: any plugin that did not load might have provided it.
                candidates = [record for record in self.plugins.values() if record.status in ("failed", "incompatible")]
        notes = [f"plugin {r.label} {_describe_status(r)}" for r in candidates if r.status != "loaded"]
        return "".join(f". {note}" for note in notes)

    def name_of(self, config_class: type) -> str:
        try:
            return self._names[config_class]
        except KeyError:
            raise UnknownTypeError(
                f"{config_class.__module__}.{config_class.__qualname__} is not a registered type; "
                "register it in a plugin's hook"
            ) from None

    def implementation_of(self, config: PolymorphicConfig) -> Any:
        """The implementation registered for `config`'s type (None for a type that has none, such as `none`)."""
        return self.resolve(config.kind, self.name_of(type(config))).load_implementation()

    def is_registered(self, config_class: type) -> bool:
        return config_class in self._names

    def type_name_or(self, config_class: type, default: str) -> str:
        """The type name of a registered config class, else `default` (a class no plugin of this registry
        registered, e.g. in a gloo rank that did not get its parent's in-process plugin)."""
        return self._names.get(config_class, default)

    def available(self, kind: str) -> list[str]:
        return sorted(name for entry_kind, name in self._types if entry_kind == kind)

    def describe_available(self, kind: str) -> str:
        return ", ".join(self.available(kind)) or "none"

    def entries(self, kind: str | None = None) -> list[TypeEntry]:
        return [entry for (entry_kind, _), entry in sorted(self._types.items()) if kind in (None, entry_kind)]

    def problems(self) -> list[str]:
        """Every plugin that did not load and every conflicting type, one line each."""
        lines = [f"plugin {r.label} {_describe_status(r)}" for r in self.plugins.values() if r.status in _BAD]
        lines += [self._conflict_message(kind, name) for kind, name in self._conflicts]
        lines += [
            f"preset {name!r} is registered by both {' and '.join(entry.plugin.label for entry in entries)}: neither "
            "is used"
            for name, entries in self.preset_conflicts.items()
        ]
        return lines

    def _conflict_message(self, kind: str, name: str) -> str:
        """Who registers a conflicting type, and a way out that leaves one of them (for each but the first)."""
        entries = self._conflicts[(kind, name)]
        owners = " and ".join(entry.plugin.label for entry in entries)
        ways = [
            f"`pip uninstall {entry.plugin.distribution}` or BLOCKZOO_DISABLE_PLUGINS={self.selector(entry.plugin)}"
            if entry.plugin.distribution
            else f"BLOCKZOO_DISABLE_PLUGINS={self.selector(entry.plugin)}"
            for entry in entries[1:]
        ]
        return f"{kind} type {name!r} is registered by both {owners}: neither is used. Keep one: " + "; ".join(
            f"{way} leaves out {entry.plugin.label}" for way, entry in zip(ways, entries[1:])
        )

    def conflict_lines(self, record: PluginRecord) -> list[str]:
        """For each type of `record` that another plugin registers too: the type, the other plugins, and how to leave
        them out."""
        lines = []
        for (kind, name), entries in self._conflicts.items():
            if any(entry.plugin is record for entry in entries):
                others = [entry.plugin for entry in entries if entry.plugin is not record]
                ways = ", ".join(f"BLOCKZOO_DISABLE_PLUGINS={self.selector(other)}" for other in others)
                owners = " and ".join(other.label for other in others)
                lines.append(
                    f"{kind} type {name!r} is also registered by {owners} (neither is used; {ways} leaves it out)"
                )
        return lines

    def selector(self, record: PluginRecord) -> str:
        """How BLOCKZOO_PLUGINS / BLOCKZOO_DISABLE_PLUGINS name this plugin alone: its name, or `name:distribution`
        when another installed distribution has a plugin of that name."""
        namesakes = [other for other in self.plugins.values() if other.name == record.name]
        return record.name if len(namesakes) < 2 or not record.distribution else f"{record.name}:{record.distribution}"

    def check_environment(self, record: PluginRecord) -> list[str]:
        """The problems a loaded plugin's `check_environment` hook reports."""
        if record.status != "loaded" or record.module is None:
            return []
        with self._alone(record.module) as hooks:
            results = hooks.check_environment()
        return list(results[0] or []) if results else []

    @contextlib.contextmanager
    def _alone(self, module: Any) -> Iterator[Any]:
        """pluggy's hooks of the plugin `module` alone (`hooks.register_mixers(register=...)`), validated as it is
        registered (a hook pluggy does not know, arguments a hook does not take)."""
        try:
            self.plugin_manager.register(module)
            self.plugin_manager.check_pending()
            yield self.plugin_manager.hook
        finally:
            if self.plugin_manager.is_registered(module):  # also half-registered by a failed validation
                self.plugin_manager.unregister(module)

    # -- loading -----------------------------------------------------------------------------------------------------

    def add_plugin(self, module: Any, record: PluginRecord) -> None:
        """Register an imported plugin module (or object) and the types its hooks register."""
        self.plugins[unique_key(self.plugins, record.name)] = record
        record.module = module
        try:
            self._claim(module, record)
            with self._alone(module) as hooks:
                self._register_from(hooks, module, record)
        except Exception as error:  # noqa: BLE001 - a broken plugin must not take the host down
            self._fail(module, record, "failed", error)

    def _claim(self, module: Any, record: PluginRecord) -> None:
        """One plugin per `name:distribution`, and one name per plugin module."""
        key = f"{record.name}:{record.distribution}"
        if key in self._loaded:
            raise ValueError(f"Plugin name already registered: {key}")
        if any(loaded is module for loaded in self._loaded.values()):
            raise ValueError(f"Plugin already registered under a different name: {key}")
        self._loaded[key] = module

    def _register_from(self, hooks: Any, module: Any, record: PluginRecord) -> None:
        """Ask the plugin what it is (`plugin_info`) and what it registers; commit it all once every hook succeeded."""
        info = hooks.plugin_info()
        record.info = info[0] if info else None
        if record.info is not None and not isinstance(record.info, PluginInfo):
            raise TypeError(f"plugin_info must return blockzoo.api.PluginInfo, got {record.info!r}")
        if (problem := api_version_problem(record.info)) is not None:
            self._fail(module, record, "incompatible", problem)
            return
        staged: list[TypeEntry] = []
        converters: list[ConverterEntry] = []
        staged_presets: list[presets.PresetEntry] = []
        for hook_name, kinds in REGISTER_HOOKS.items():
            register = functools.partial(self._stage, staged, record, hook_name, kinds)
            getattr(hooks, hook_name)(register=register)
        hooks.register_converters(
            register=lambda fmt, section: converters.append(ConverterEntry(format=fmt, section=section, plugin=record))
        )
        presets.stage(record, hooks.register_presets, staged_presets, _check_type_name)
        if record.info is not None and (problem := capability_api_problem(record.info, staged)):
            self._fail(module, record, "failed", problem)
            return
        for entry in staged:
            self._commit(entry)
        self.converters.extend(converters)
        presets.commit(self.presets, self.preset_conflicts, staged_presets)

    def _stage(
        self,
        staged: list[TypeEntry],
        record: PluginRecord,
        hook: str,
        kinds: set[str] | None,
        name: str,
        config_class: type,
        implementation: str | None = None,
    ) -> None:
        if not (isinstance(config_class, type) and issubclass(config_class, PolymorphicConfig)):
            raise TypeError(
                f"{hook}: {config_class!r} is not a subclass of a config kind (MixerConfig, MLPConfig, ...)"
            )
        kind = config_class.kind
        if (kinds is not None and kind not in kinds) or (kinds is None and kind in _OWN_KINDS):
            right = next(h for h, k in REGISTER_HOOKS.items() if k is None or kind in k)
            raise TypeError(f"{hook} registered {name!r} of kind {kind!r}; register it from {right}")
        _check_type_name(record, name)
        if config_class in self._names or any(e.config_class is config_class for e in staged):
            raise TypeError(f"{config_class.__qualname__} is registered twice (as {name!r}); one name per config class")
        if implementation is not None and not re.fullmatch(r"[\w.]+:[\w.]+", implementation):
            raise TypeError(f"implementation of {name!r} must be 'module:attribute', got {implementation!r}")
        staged.append(
            TypeEntry(kind=kind, name=name, config_class=config_class, implementation=implementation, plugin=record)
        )

    def _commit(self, entry: TypeEntry) -> None:
        key = (entry.kind, entry.name)
        entry.plugin.types.setdefault(entry.kind, []).append(entry.name)
        if key in self._conflicts:
            self._conflicts[key].append(entry)
        elif key in self._types:
            previous = self._types.pop(key)
            del self._names[previous.config_class]
            self._conflicts[key] = [previous, entry]
        else:
            self._types[key] = entry
            self._names[entry.config_class] = entry.name
            return
        for conflicting in self._conflicts[key]:
            if f"{entry.kind}:{entry.name}" not in conflicting.plugin.conflicts:
                conflicting.plugin.conflicts.append(f"{entry.kind}:{entry.name}")

    def _fail(self, module: Any, record: PluginRecord, status: str, error: BaseException | str) -> None:
        record.status = status
        if isinstance(error, str):
            record.error = error
        else:
            record.error, record.traceback = describe_error(error), traceback_text(error)
        key = f"{record.name}:{record.distribution}"
        if self._loaded.get(key) is module:
            del self._loaded[key]


_BAD = ("failed", "incompatible")


def describe_error(error: BaseException) -> str:
    """`Type: message (file:line)`, the place being where it was raised: the line of a syntax error, else the last
    frame of the traceback that is a real file (not importlib's frozen frames)."""
    place = None
    if isinstance(error, SyntaxError) and error.filename:
        place = f"{error.filename}:{error.lineno}"
    else:
        frames = [frame for frame in traceback.extract_tb(error.__traceback__) if not frame.filename.startswith("<")]
        if frames:
            place = f"{frames[-1].filename}:{frames[-1].lineno}"
    return f"{type(error).__name__}: {error}" + (f" ({place})" if place else "")


def traceback_text(error: BaseException) -> str:
    return "".join(traceback.format_exception(type(error), error, error.__traceback__))


def _describe_status(record: PluginRecord) -> str:
    if record.status == "disabled":
        return f"is disabled ({record.error})"
    if record.status == "incompatible":
        return f"is incompatible: {record.error}"
    return f"failed to load: {record.error}"


def unique_key(records: Mapping[str, PluginRecord], name: str) -> str:
    key, index = name, 1
    while key in records:
        index += 1
        key = f"{name}#{index}"
    return key


def _check_type_name(record: PluginRecord, name: str) -> None:
    if not isinstance(name, str):
        raise TypeError(f"a type name must be a string, got {name!r}")
    if record.first_party:
        if not _NAME.fullmatch(name):
            raise TypeError(f"first-party type name {name!r} must be lowercase letters, digits and underscores")
        return
    prefix, dot, rest = name.partition(".")
    if not (dot and prefix == record.name and _NAME.fullmatch(rest)):
        raise TypeError(
            f"type name {name!r} must be '{record.name}.<name>' (third-party types carry their plugin's name)"
        )
