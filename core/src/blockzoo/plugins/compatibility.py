"""The version handshake: whether a plugin works with this core. Its distribution's `blockzoo` requirement must
include the installed core, the plugin API it declares (`plugin_info`) must be this core's major version and no
newer minor, and the capabilities it claims must exist in the API version it declares."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from blockzoo.plugins.hookspecs import CAPABILITY_API, PLUGIN_API, PROJECT, PluginInfo

if TYPE_CHECKING:
    from blockzoo.plugins.registry import PluginRecord, TypeEntry


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


def api_version_problem(info: PluginInfo | None) -> str | None:
    """Why the plugin API a plugin was written for is not one this core provides, or None."""
    if info is None or api_compatible(info.api_version):
        return None
    version = ".".join(map(str, info.api_version))
    return f"written for plugin API {version}; this blockzoo provides {PLUGIN_API[0]}.{PLUGIN_API[1]}"


def api_compatible(version: Any) -> bool:
    return (
        isinstance(version, tuple)
        and len(version) == 2
        and version[0] == PLUGIN_API[0]
        and isinstance(version[1], int)
        and version[1] <= PLUGIN_API[1]
    )


def core_version() -> str:
    """The installed core's version, from its distribution's metadata (what pip resolved plugins' requirements
    against)."""
    return importlib.metadata.version(PROJECT)


def requirement_problem(distribution: importlib.metadata.Distribution) -> str | None:
    """Why the distribution's declared `blockzoo` requirement excludes this core, or None."""
    installed = Version(core_version())
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
    core = Version(core_version())
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
