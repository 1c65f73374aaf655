"""`blockzoo plugins`, `blockzoo models` and `blockzoo --version`: what is installed. Torch-free (`blockzoo plugins`
answers without loading torch; `--check` probes each plugin's modules in a fresh interpreter)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from blockzoo.config import ConfigError, structure
from blockzoo.plugins import PLUGIN_API, PluginRecord, Registry, get_registry, strict_mode, undeclared_core


def register(commands: argparse._SubParsersAction) -> None:
    plugins = commands.add_parser("plugins", help="list the installed plugins and the types they provide")
    plugins.add_argument("--json", action="store_true", help="machine-readable output")
    plugins.add_argument("--check", action="store_true", help="also build every type and check the environment")
    plugins.add_argument("--verbose", action="store_true", help="the traceback of each plugin that failed to load")
    plugins.set_defaults(run=_plugins)

    models = commands.add_parser("models", help="list the named architectures (presets) the installed plugins ship")
    shown = models.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true", help="machine-readable output")
    shown.add_argument("--markdown", action="store_true", help="the catalogue as docs/models.md holds it")
    models.set_defaults(run=_models)


def version() -> int:
    """`blockzoo 0.1.0`, then each plugin's distribution and version (the ones that did not load say so)."""
    from blockzoo import __version__

    print(f"blockzoo {__version__}")
    for record in get_registry(strict=False).plugins.values():
        if record.distribution and record.name != "blockzoo":
            status = "" if record.status == "loaded" else f" ({record.status})"
            print(f"{record.distribution} {record.version} (plugin {record.name!r}){status}")
    return 0


def _models(arguments: argparse.Namespace) -> int:
    from blockzoo import preset_catalogue

    found = preset_catalogue.rows()
    if arguments.json:
        print(json.dumps(found, indent=2))
    elif arguments.markdown:
        print(preset_catalogue.markdown(found), end="")
    else:
        print(preset_catalogue.table(found))
    return 0


def _plugins(arguments: argparse.Namespace) -> int:
    from blockzoo import __version__

    registry = get_registry(strict=False)
    checks = {}
    if arguments.check:
        checks = {name: _check_plugin(registry, r) for name, r in registry.plugins.items() if r.status == "loaded"}
    problems = registry.problems()
    if arguments.json:
        report = {
            "blockzoo": __version__,
            "plugin_api": f"{PLUGIN_API[0]}.{PLUGIN_API[1]}",
            "plugins": [
                record.to_dict() | _conversions(registry, record) | ({"check": checks[name]} if name in checks else {})
                for name, record in registry.plugins.items()
            ],
            "problems": problems,
        }
        print(json.dumps(report, indent=2))
    else:
        print(f"blockzoo {__version__}, plugin API {PLUGIN_API[0]}.{PLUGIN_API[1]}")
        for name, record in registry.plugins.items():
            _print_record(registry, record, checks.get(name), verbose=arguments.verbose)
    failed_checks = any(checks.values())
    if problems and strict_mode():
        print("blockzoo: error: plugins did not load and BLOCKZOO_STRICT_PLUGINS is set", file=sys.stderr)
        return 1
    return 1 if failed_checks else 0


def _conversions(registry: Registry, record: PluginRecord) -> dict[str, list[str]]:
    """The checkpoint formats the plugin provides, and those it contributes sections to (for its own types)."""
    from blockzoo.conversion import CheckpointFormat

    entries = [entry for entry in registry.converters if entry.plugin is record]
    kinds = {
        "formats": [entry.format for entry in entries if isinstance(entry.section, CheckpointFormat)],
        "sections_for": sorted({entry.format for entry in entries if not isinstance(entry.section, CheckpointFormat)}),
    }
    return {kind: names for kind, names in kinds.items() if names}


def _print_record(registry: Registry, record: PluginRecord, check: list[str] | None, *, verbose: bool) -> None:
    version = f"{record.distribution} {record.version}" if record.distribution else "(not installed)"
    print(f"\n{record.name}  [{record.status}]  {version}")
    if record.location:
        print(f"  location: {record.location}")
    if record.error:
        print(f"  error: {record.error}")
        if record.traceback and verbose:
            print("    " + record.traceback.rstrip().replace("\n", "\n    "))
    if record.info is not None:
        print(f"  plugin API: {record.info.api_version[0]}.{record.info.api_version[1]}")
        if record.info.capabilities:
            print(f"  capabilities: {', '.join(record.info.capabilities)}")
    for kind, names in record.types.items():
        print(f"  {kind}: {', '.join(names)}")
    for kind, names in _conversions(registry, record).items():
        print(f"  {kind.replace('_', ' ')}: {', '.join(names)}")
    for conflict in registry.conflict_lines(record):
        print(f"  conflict: {conflict}")
    if check is not None:
        print("  check: ok" if not check else "\n".join(f"  check: {problem}" for problem in check))


# Containers whose defaults are made of other plugins' types: their default config is not required to build.


# Containers whose defaults are made of other plugins' types: their default config is not required to build.
_CONTAINER_KINDS = ("block", "block_sequence")


def _check_plugin(registry: Registry, record: PluginRecord) -> list[str]:
    """Build every type of a loaded plugin (default config + implementation) and run `check_environment`."""
    problems = []
    for entry in registry.entries():
        if entry.plugin is not record:
            continue
        label = f"{entry.kind} {entry.name!r}"
        try:
            if entry.kind not in _CONTAINER_KINDS and not _has_required_fields(entry.config_class):
                structure({}, entry.config_class)
        except ConfigError as error:
            problems.append(f"{label}: its default config does not build: {error}")
        try:
            entry.load_implementation()
        except Exception as error:  # noqa: BLE001 - reported, not raised
            problems.append(
                f"{label}: implementation {entry.implementation} does not import: {type(error).__name__}: {error}"
            )
    try:
        problems.extend(registry.check_environment(record))
    except Exception as error:  # noqa: BLE001
        problems.append(f"check_environment raised {type(error).__name__}: {error}")
    if problem := undeclared_core(record):
        problems.append(problem)
    modules = {record.module.__name__} | {e.config_class.__module__ for e in registry.entries() if e.plugin is record}
    problems += [
        f"importing {module} imports torch: a plugin's config and hook modules must not (blockzoo config and "
        "blockzoo plugins load them without torch); import torch in the layer's module"
        for module in sorted(modules)
        if _imports_torch(module)
    ]
    return problems


def _has_required_fields(config_class: type) -> bool:
    """Whether a config has fields without a default (a benchmark's tasks): it has no default config to build."""
    import attrs

    return any(field.default is attrs.NOTHING for field in attrs.fields(config_class))


def _imports_torch(module: str) -> bool:
    """Whether importing `module` in a fresh interpreter imports torch (this process may have imported it already)."""
    probe = f"import importlib, sys; importlib.import_module({module!r}); sys.exit(10 if 'torch' in sys.modules else 0)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, check=False).returncode == 10
