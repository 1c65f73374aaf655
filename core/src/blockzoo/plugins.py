"""Plugin discovery and the type registry (DESIGN.md "Plugin system").

Plugins are modules of pluggy hook implementations named by entry points of the group
`blockzoo.plugins`. Loading is lazy (the first time a type is looked up), sorted by plugin name so
every rank and test worker builds the same registry, and forgiving: a plugin that fails to import,
declares a `blockzoo` range that excludes this core, or registers badly is recorded with its error
and shown where its types are asked for. `BLOCKZOO_STRICT_PLUGINS=1` turns those into errors.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.metadata
import importlib.util
import os
import re
import threading
import traceback
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs
import pluggy
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from blockzoo import presets
from blockzoo.config import PolymorphicConfig, UnknownTypeError, set_type_registry
from blockzoo.errors import PluginError

PROJECT = "blockzoo"
ENTRY_POINT_GROUP = "blockzoo.plugins"
PLUGIN_API = (1, 2)  # 1.2 brought register_presets (a plugin written for 1.0 or 1.1 loads unchanged)
# The plugin API that brought each capability: a plugin written for an older one cannot implement it (1.1 brought
# Mixer.forward_slice, SequenceData and the slice exchanges). Capabilities not listed are 1.0's.
CAPABILITY_API = {"sequence_data_parallel": (1, 1)}
CORE_PLUGIN = "blockzoo"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

# First-party distributions register plain type names; everyone else uses `<plugin>.<name>`.
FIRST_PARTY_DISTRIBUTIONS = frozenset(
    {
        "blockzoo",
        "blockzoo-attention",
        "blockzoo-mamba",
        "blockzoo-mamba-2",
        "blockzoo-discrete-mamba-2",
        "blockzoo-gated-delta-net",
        "blockzoo-mla",
        "blockzoo-mlp",
        "blockzoo-moe",
        "blockzoo-huggingface",
        "blockzoo-tensorboard",
        "blockzoo-wandb",
        "blockzoo-mlflow",
        "blockzoo-lm-eval",
    }
)
# Where a first-party type comes from, to tell a user what to install.
FIRST_PARTY_TYPES = {
    ("mixer", "attention"): "blockzoo-attention",
    ("mixer", "mamba"): "blockzoo-mamba",
    ("mixer", "mamba_2"): "blockzoo-mamba-2",
    ("mixer", "discrete_mamba_2"): "blockzoo-discrete-mamba-2",
    ("mixer", "gated_delta_net"): "blockzoo-gated-delta-net",
    ("mixer", "mla"): "blockzoo-mla",
    ("mlp", "mlp"): "blockzoo-mlp",
    ("mlp", "moe"): "blockzoo-moe",
    ("tracker", "tensorboard"): "blockzoo-tensorboard",
    ("tracker", "wandb"): "blockzoo-wandb",
    ("tracker", "mlflow"): "blockzoo-mlflow",
    ("benchmark", "lm_eval"): "blockzoo-lm-eval",
}

# Which kinds each registration hook may register.
REGISTER_HOOKS = {
    "register_mixers": {"mixer"},
    "register_mlps": {"mlp"},
    "register_blocks": {"block", "block_sequence"},
    "register_components": None,  # any other kind: normalizations, initializations, rotary, ...
}
_OWN_KINDS = {"mixer", "mlp", "block", "block_sequence"}
_NAME = re.compile(r"[a-z][a-z0-9_]*")


class HookSpecs:
    """The hooks a plugin may implement. Registration hooks take a `register` callback."""

    @hookspec
    def register_mixers(self, register: Callable) -> None:
        """`register(name, config_class, implementation="module:Class")` for each mixer type."""

    @hookspec
    def register_mlps(self, register: Callable) -> None:
        """`register(name, config_class, implementation)` for each MLP type."""

    @hookspec
    def register_blocks(self, register: Callable) -> None:
        """`register(name, config_class, implementation)` for each block and block-sequence type."""

    @hookspec
    def register_components(self, register: Callable) -> None:
        """`register(name, config_class, implementation)` for the other kinds: normalization, initialization, ..."""

    @hookspec
    def register_converters(self, register: Callable) -> None:
        """`register(format, section)` for each checkpoint-format section the plugin contributes: a
        `blockzoo.api.Section` says how one of its config classes (fields and weights) is written in the format
        named `format` (e.g. Hugging Face `llama`); a converter plugin registers the format itself the same way,
        `register(name, checkpoint_format)` with a `blockzoo.api.CheckpointFormat`. See `blockzoo.conversion`."""

    @hookspec
    def register_presets(self, register: Callable) -> None:
        """`register(name, preset)` for each named architecture the plugin ships, a `blockzoo.api.Preset` (plugin API
        1.2; see `blockzoo.presets`). Names follow the type names' rule: plain for first-party plugins, else
        `<plugin>.<name>`."""

    @hookspec
    def plugin_info(self) -> PluginInfo:
        """The plugin API version the plugin was written for, and its capabilities."""

    @hookspec
    def check_environment(self) -> list[str] | None:
        """Problems with the environment (missing kernels, no GPU, ...); empty or None when all is well."""


def _check_api_version(_: Any, __: Any, value: Any) -> None:
    if not (isinstance(value, tuple) and len(value) == 2 and all(type(part) is int and part >= 0 for part in value)):
        raise ValueError(
            f"PluginInfo(api_version={value!r}): give (major, minor) as two ints, e.g. api_version={PLUGIN_API!r}"
        )


def _check_capabilities(_: Any, __: Any, value: Any) -> None:
    if not (isinstance(value, tuple) and all(isinstance(name, str) for name in value)):
        raise ValueError(
            f"PluginInfo(capabilities={value!r}): give a tuple of capability names, e.g. "
            'capabilities=("sequence_data_parallel",)'
        )


@attrs.frozen(kw_only=True)
class PluginInfo:
    """What a plugin says about itself (its `plugin_info` hook): the plugin API version it was written for
    (`(major, minor)`), its capabilities and a one-line description."""

    api_version: tuple[int, int] = attrs.field(default=PLUGIN_API, validator=_check_api_version)
    capabilities: tuple[str, ...] = attrs.field(default=(), validator=_check_capabilities)
    description: str = ""


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
        return self.distribution is not None and canonicalize_name(self.distribution) in FIRST_PARTY_DISTRIBUTIONS

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
        self.plugin_manager = pluggy.PluginManager(PROJECT)
        self.plugin_manager.add_hookspecs(HookSpecs)
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
            distribution = FIRST_PARTY_TYPES.get((kind, name))
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
        hook = _hook(record.module, "check_environment")
        return list(hook() or []) if hook is not None else []

    # -- loading -----------------------------------------------------------------------------------------------------

    def add_plugin(self, module: Any, record: PluginRecord) -> None:
        """Register an imported plugin module (or object) and the types its hooks register."""
        self.plugins[_unique_key(self.plugins, record.name)] = record
        record.module = module
        try:
            self.plugin_manager.register(module, name=f"{record.name}:{record.distribution}")
            self.plugin_manager.check_pending()
            info = _hook(module, "plugin_info")
            record.info = info() if info is not None else None
            if record.info is not None and not isinstance(record.info, PluginInfo):
                raise TypeError(f"plugin_info must return blockzoo.api.PluginInfo, got {record.info!r}")
        except Exception as error:  # noqa: BLE001 - a broken plugin must not take the host down
            self._fail(module, record, "failed", error)
            return
        if record.info is not None and not _api_compatible(record.info.api_version):
            version = ".".join(map(str, record.info.api_version))
            message = f"written for plugin API {version}; this blockzoo provides {PLUGIN_API[0]}.{PLUGIN_API[1]}"
            self._fail(module, record, "incompatible", message)
            return
        staged: list[TypeEntry] = []
        converters: list[ConverterEntry] = []
        staged_presets: list[presets.PresetEntry] = []
        try:
            for hook_name, kinds in REGISTER_HOOKS.items():
                if (hook := _hook(module, hook_name)) is not None:
                    hook(register=functools.partial(self._stage, staged, record, hook_name, kinds))
            if (hook := _hook(module, "register_converters")) is not None:
                hook(
                    register=lambda fmt, section: converters.append(
                        ConverterEntry(format=fmt, section=section, plugin=record)
                    )
                )
            if (hook := _hook(module, "register_presets")) is not None:
                presets.stage(record, hook, staged_presets, _check_type_name)
        except Exception as error:  # noqa: BLE001
            self._fail(module, record, "failed", error)
            return
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
            record.error, record.traceback = describe_error(error), _traceback_text(error)
        if self.plugin_manager.is_registered(module):
            self.plugin_manager.unregister(module)


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


def _traceback_text(error: BaseException) -> str:
    return "".join(traceback.format_exception(type(error), error, error.__traceback__))


def _hook(module: Any, name: str) -> Callable | None:
    """The plugin's implementation of hook `name` (a function marked with `blockzoo.hookimpl`), if any."""
    function = getattr(module, name, None)
    return function if callable(function) and hasattr(function, f"{PROJECT}_impl") else None


def _describe_status(record: PluginRecord) -> str:
    if record.status == "disabled":
        return f"is disabled ({record.error})"
    if record.status == "incompatible":
        return f"is incompatible: {record.error}"
    return f"failed to load: {record.error}"


def _unique_key(records: Mapping[str, PluginRecord], name: str) -> str:
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


def capability_api_problem(info: PluginInfo, entries: Iterable[TypeEntry] = ()) -> str | None:
    """Why a plugin's declared plugin API cannot hold the capabilities it claims (in `plugin_info` or on the config
    classes of its types, `entries`), or None."""
    claimed: dict[str, list[str]] = {name: [] for name in info.capabilities}
    for entry in entries:
        for name in sorted(getattr(entry.config_class, "capabilities", ())):
            claimed.setdefault(name, []).append(entry.name)
    newer = [
        (name, CAPABILITY_API[name]) for name in sorted(claimed) if CAPABILITY_API.get(name, (1, 0)) > info.api_version
    ]
    if not newer:
        return None
    declared = ".".join(map(str, info.api_version))
    needed = max(version for _, version in newer)
    claims = "; ".join(
        f"{name} (plugin API {'.'.join(map(str, version))}; claimed by "
        + ", ".join([*(["plugin_info"] if name in info.capabilities else []), *claimed[name]])
        + ")"
        for name, version in newer
    )
    return (
        f"declares plugin API {declared} (plugin_info's api_version) but claims capabilities a {declared} core does "
        f"not have: {claims}. Declare PluginInfo(api_version={needed!r}, ...) (and a blockzoo requirement that "
        "provides it), or drop the capability"
    )


def _api_compatible(version: Any) -> bool:
    return (
        isinstance(version, tuple)
        and len(version) == 2
        and version[0] == PLUGIN_API[0]
        and isinstance(version[1], int)
        and version[1] <= PLUGIN_API[1]
    )


def _core_version() -> str:
    """The installed core's version, from its distribution's metadata (what pip resolved plugins' requirements
    against)."""
    return importlib.metadata.version(PROJECT)


def _requirement_problem(distribution: importlib.metadata.Distribution) -> str | None:
    """Why the distribution's declared `blockzoo` requirement excludes this core, or None."""
    installed = Version(_core_version())
    for line in distribution.requires or ():
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            return f"cannot parse its requirement {line!r}"
        if canonicalize_name(requirement.name) != PROJECT:
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        if not requirement.specifier.contains(installed, prereleases=True):
            return f"requires {requirement}, but blockzoo {installed} is installed"
    return None


def undeclared_core(record: PluginRecord) -> str | None:
    """Why an installed plugin's distribution does not say which blockzoo it works with (no `blockzoo` requirement),
    or None."""
    if record.distribution is None or canonicalize_name(record.distribution) == PROJECT:
        return None
    try:
        requires = importlib.metadata.distribution(record.distribution).requires or ()
    except importlib.metadata.PackageNotFoundError:
        return None
    if any(_requirement_name(line) == PROJECT for line in requires):
        return None
    core = Version(_core_version())
    example = f"blockzoo>={core.major}.{core.minor},<{core.major}.{core.minor + 1}"
    return (
        f"{record.distribution} declares no requirement on blockzoo: add one to its dependencies (e.g. "
        f'"{example}", as the template does), so that pip keeps the two compatible'
    )


def _requirement_name(line: str) -> str | None:
    try:
        return canonicalize_name(Requirement(line).name)
    except InvalidRequirement:
        return None


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
        elif distribution is not None and (problem := _requirement_problem(distribution)):
            record.status, record.error = "incompatible", problem
        if record.status != "loaded":
            registry.plugins[_unique_key(registry.plugins, record.name)] = record
            continue
        try:
            module = entry_point.load()
        except BaseException as error:
            if isinstance(error, KeyboardInterrupt):
                raise
            record.status, record.error = "failed", describe_error(error)
            record.traceback = _traceback_text(error)
            registry.plugins[_unique_key(registry.plugins, record.name)] = record
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


# Config structuring resolves `type` names through this registry; config.py imports nothing of this module.
set_type_registry(get_registry)
