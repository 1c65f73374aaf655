"""The hooks a plugin implements, the markers for them, and what a plugin says about itself (DESIGN.md "Plugin
system"). Plugin API 1.x: a hook added here is optional, so plugins written for an older 1.x load unchanged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import pluggy

PROJECT = "blockzoo"
ENTRY_POINT_GROUP = "blockzoo.plugins"
# 1.3 brought blockzoo.api.FileTokenizer and format_activation (names tied to no library); 1.2 register_presets. A
# plugin written for an older 1.x loads unchanged.
PLUGIN_API = (1, 3)
# The plugin API that brought each capability: a plugin written for an older one cannot implement it (1.1 brought
# Mixer.forward_slice, SequenceData and the slice exchanges). Capabilities not listed are 1.0's.
CAPABILITY_API = {"sequence_data_parallel": (1, 1)}
CORE_PLUGIN = "blockzoo"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

# Which kinds each type-registration hook may register.
REGISTER_HOOKS = {
    "register_mixers": {"mixer"},
    "register_mlps": {"mlp"},
    "register_blocks": {"block", "block_sequence"},
    "register_components": None,  # any other kind: normalizations, initializations, rotary, ...
}


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
