"""Named architectures ("presets") that plugins ship: `model: {preset: NAME, ...overrides}`, `blockzoo models`,
`blockzoo init PRESET`, `blockzoo.build("qwen3_0_6b")`, `blockzoo.presets.get(name)`.

A plugin registers each preset from its `register_presets(register)` hook, `register(name, Preset(...))`. A preset
is data: its model config, written either as the model's published config in its checkpoint format's own keys
(`format_config`, read through the format named by `format`, so a transcription has one place to be wrong and the
format's checks compare it with the format's own library) or as a blockzoo model config (`config`, plain data or a
function returning it); the exact parameter count, the figure its authors published, the source it was transcribed
from, and the distributions it needs. A preset whose distributions are not all installed is listed as unavailable,
with what to install. Torch-free.
"""

from __future__ import annotations

import difflib
import importlib.metadata
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from blockzoo.errors import UsageError


def _check_names(field_name: str, what: str) -> Callable[[Any, Any, Any], None]:
    def check(_: Any, __: Any, value: Any) -> None:
        if not (isinstance(value, tuple) and all(isinstance(name, str) for name in value)):
            raise ValueError(f"Preset({field_name}={value!r}): give a tuple of {what}")

    return check


@attrs.frozen(kw_only=True, init=False)
class Preset:
    """A named architecture a plugin registers (`register(name, Preset(...))` in its `register_presets` hook).

    `family`: what it belongs to ("Llama 3", "Falcon-H1"). `format_config`: the published config (its architecture
    keys, as published: a config.json), read through `format`; or `config`: the blockzoo model config (plain data, or a
    function returning it). `parameters`: the exact parameter count (checked by the tests); `active_parameters`: those
    a token uses (MoE). `published_parameters`: the figure the model's authors give ("1.23B"), None for an
    architecture of ours. `source`: where the values were transcribed from. `format`: the checkpoint format it
    corresponds to. `requires`: the distributions it needs. `notes`: what was chosen where the source says nothing.
    `checked_against`: the stored copies of the published values the preset was compared with, each naming where it
    is (a URL, or repository and path) and which fields it confirms.
    """

    family: str
    parameters: int
    source: str
    requires: tuple[str, ...] = attrs.field(validator=_check_names("requires", "distribution names"))
    format: str | None = None
    format_config: Mapping[str, Any] | None = None
    config: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None
    active_parameters: int | None = None
    published_parameters: str | None = None
    notes: str = ""
    checked_against: tuple[str, ...] = attrs.field(default=(), validator=_check_names("checked_against", "sources"))

    def __init__(self, *, huggingface_config: Mapping[str, Any] | None = None, **fields: Any) -> None:
        # `format_config`'s former name: presets written with it still register.
        if huggingface_config is not None:
            fields["format_config"] = huggingface_config
        self.__attrs_init__(**fields)

    def __attrs_post_init__(self) -> None:
        if (self.format_config is None) == (self.config is None):
            raise ValueError("a Preset gives either format_config (with its format) or config, not both")
        if self.format_config is not None and self.format is None:
            raise ValueError("a Preset's format_config is read through its format: give format=")

    @property
    def huggingface_config(self) -> Mapping[str, Any] | None:
        """`format_config`, by its former name."""
        return self.format_config

    @classmethod
    def published(
        cls, family: str, repository: str, config: Mapping[str, Any], parameters: int, published: str, **fields: Any
    ) -> Preset:
        """A published model: the architecture keys of the config.json of its Hugging Face `repository` (the
        source), read through the format its `model_type` names; `fields`: `requires`, `active_parameters`,
        `notes`, `checked_against`."""
        source = f"https://huggingface.co/{repository}/blob/main/config.json"
        return cls(family=family, format=config["model_type"], format_config=config, parameters=parameters,
                   published_parameters=published, source=source, **fields)  # fmt: skip

    @classmethod
    def proxy(cls, family: str, base_name: str, base: Mapping[str, Any], parameters: int, **fields: Any) -> Preset:
        """An architecture of ours: the config.json of preset `base_name` (`base`) with `fields["changes"]`; the
        other `fields` as for `published`."""
        changes = fields.pop("changes")
        source = f"ours: {base_name} with " + ", ".join(f"{key}={value}" for key, value in changes.items())
        return cls(family=family, format=base["model_type"], format_config={**base, **changes},
                   parameters=parameters, source=source, **fields)  # fmt: skip

    @property
    def ours(self) -> bool:
        """An architecture of ours (a small proxy), not a published model."""
        return self.published_parameters is None

    def model_data(self) -> dict[str, Any]:
        """The model config, plain data."""
        if self.format_config is not None:
            from blockzoo.conversion import get_format

            return get_format(self.format).import_config(self.format_config, source=f"the preset's {self.format}")
        config = self.config() if callable(self.config) else self.config
        return dict(config)


@attrs.frozen(kw_only=True)
class PresetEntry:
    """A registered preset: its name, the preset, and the plugin that registered it."""

    name: str
    preset: Preset
    plugin: Any  # plugins.PluginRecord

    def missing(self) -> list[str]:
        """The distributions the preset needs that are not installed (or whose plugin did not load)."""
        from blockzoo.plugins import get_registry

        loaded = {
            record.distribution.lower().replace("_", "-")
            for record in get_registry(strict=False).plugins.values()
            if record.status == "loaded" and record.distribution
        }
        return [name for name in self.preset.requires if name.lower().replace("_", "-") not in loaded]

    @property
    def available(self) -> bool:
        return not self.missing()

    def install_hint(self) -> str:
        return "pip install " + " ".join(self.missing())


def stage(record: Any, hook: Callable, staged: list[PresetEntry], check_name: Callable[[Any, str], None]) -> None:
    """Call a plugin's `register_presets` hook, staging what it registers (committed when the whole plugin loads)."""

    def register(name: str, preset: Preset) -> None:
        check_name(record, name)
        if not isinstance(preset, Preset):
            raise TypeError(f"register_presets: preset {name!r} must be a blockzoo.api.Preset, got {preset!r}")
        if any(entry.name == name for entry in staged):
            raise TypeError(f"register_presets: preset {name!r} is registered twice")
        staged.append(PresetEntry(name=name, preset=preset, plugin=record))

    hook(register=register)


def commit(entries: dict[str, PresetEntry], conflicts: dict[str, list[PresetEntry]], new: list[PresetEntry]) -> None:
    """Add staged presets; a name registered by two plugins is kept by neither (both are named when it is asked for)."""
    for entry in new:
        if entry.name in conflicts:
            conflicts[entry.name].append(entry)
        elif entry.name in entries:
            conflicts[entry.name] = [entries.pop(entry.name), entry]
        else:
            entries[entry.name] = entry


# ---------------------------------------------------------------------------------------------------------------------
# Lookup


def _registry():
    from blockzoo.plugins import get_registry

    return get_registry()


def entries() -> list[PresetEntry]:
    """Every registered preset, by name (available or not)."""
    registry = _registry()
    return [registry.presets[name] for name in sorted(registry.presets)]


def names() -> list[str]:
    return [entry.name for entry in entries()]


def entry(name: str) -> PresetEntry:
    """The registered preset `name`; an unknown name, a name two plugins register or a preset whose distributions
    are missing is a `UsageError` that says so."""
    registry = _registry()
    if not isinstance(name, str):
        raise UsageError(f"a preset name is a string, got {name!r}")
    if name in registry.preset_conflicts:
        owners = " and ".join(found.plugin.label for found in registry.preset_conflicts[name])
        raise UsageError(f"preset {name!r} is registered by both {owners}: neither is used; uninstall one")
    found = registry.presets.get(name)
    if found is None:
        close = difflib.get_close_matches(name, list(registry.presets), n=1)
        suggestion = f"; did you mean {close[0]!r}?" if close else ""
        raise UsageError(
            f"unknown preset {name!r}{suggestion} (`blockzoo models` lists the installed ones; a plugin registers more)"
        )
    if missing := found.missing():
        raise UsageError(f"preset {name!r} needs {', '.join(missing)}, not installed: {found.install_hint()}")
    return found


def get(name: str) -> Preset:
    """The preset `name` (`blockzoo.presets.get("qwen3_0_6b")`)."""
    return entry(name).preset


def model_data(name: str) -> dict[str, Any]:
    """The plain data of preset `name`'s model config."""
    return entry(name).preset.model_data()


def model_config(name: str, overrides: Mapping[str, Any] | None = None):
    """Preset `name`'s `ModelConfig`, with `overrides` merged into its own types (`{"decoder": {"num_blocks": 4}}`)."""
    from blockzoo.config import structure
    from blockzoo.model.config import ModelConfig

    return structure({"preset": name, **(overrides or {})}, ModelConfig, root="model")


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def describe_count(count: int | None) -> str:
    """1_235_814_400 -> '1.24B', 135_000_000 -> '135M'."""
    if count is None:
        return "-"
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            value = count / size
            return f"{value:.3g}{unit}" if value < 100 else f"{value:.0f}{unit}"
    return str(count)
