"""The config reference (`blockzoo config schema`): every config class of the core and of the installed plugins as
markdown, generated from their attrs fields (type, default, doc). Torch-free, like the configs themselves.

Sections: the plain configs reachable from `RunConfig` and from the registered types (one table each), then each
kind (mixer, MLP, normalization, ...) with its registered types, each with its plugin, capabilities and table.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import attrs
import yaml

from blockzoo import __version__
from blockzoo.config import Config, ConfigError, PolymorphicConfig, to_dict
from blockzoo.plugins import FIRST_PARTY_TYPES, PluginRecord, Registry, TypeEntry, get_registry
from blockzoo.run_config import RunConfig

REGENERATE = "blockzoo config schema > docs/config-reference.md"


def config_reference(registry: Registry | None = None) -> str:
    """The markdown reference of every config the installed core and plugins accept."""
    registry = registry or get_registry(strict=False)
    entries = registry.entries()
    kinds = sorted({entry.kind for entry in entries})
    plugins = [record for record in registry.plugins.values() if record.status == "loaded"]
    lines = [
        "# Config reference",
        "",
        f"Every config that blockzoo {__version__} and its installed plugins accept, generated from their classes by "
        f"`blockzoo config schema` (regenerate: `{REGENERATE}`). Plugins: "
        + ", ".join(_origin(record) for record in plugins)
        + ".",
        "",
        "A kind (mixer, MLP, normalization, ...) is a config chosen by its `type` key; a field left out takes its "
        "default; `null` is YAML's None. Kinds: "
        + ", ".join(f"[{kind}](#{_slug(f'kind {kind}')})" for kind in kinds)
        + ".",
        "",
        "## Configs",
    ]
    for config_class in _plain_configs([RunConfig, *(entry.config_class for entry in entries)]):
        lines += ["", f"### `{config_class.__name__}`", ""]
        if doc := _doc(config_class):
            lines += [doc, ""]
        lines += _table(config_class)
    lines += ["", "## Kinds"]
    for kind in kinds:
        kind_entries = [entry for entry in entries if entry.kind == kind]
        base = _kind_base(kind_entries[0].config_class)
        lines += ["", f"### Kind `{kind}`", ""]
        doc = _doc(base)
        summary = [doc] if doc else []
        if base.default_type and "default type" not in doc.lower():
            summary.append(f"Default type: `{base.default_type}`.")
        summary.append(
            "Types: " + ", ".join(f"[`{entry.name}`](#{_slug(f'{kind} {entry.name}')})" for entry in kind_entries) + "."
        )
        lines.append(" ".join(summary))
        for entry in kind_entries:
            lines += ["", f"#### {kind} `{entry.name}`", ""]
            lines += [_describe_entry(entry), ""]
            lines += _table(entry.config_class)
    # A kind a field names but no installed plugin provides a type of (a benchmark without blockzoo-lm-eval).
    referenced = set(re.findall(r"\]\(#kind-([a-z0-9_]+)\)", "\n".join(lines))) - set(kinds)
    for kind in sorted(referenced):
        provided = [f"`{name}` ({owner})" for (of, name), owner in FIRST_PARTY_TYPES.items() if of == kind]
        where = f": {', '.join(provided)}" if provided else ""
        lines += ["", f"### Kind `{kind}`", "", f"No installed plugin provides a type of this kind{where}."]
    return "\n".join(lines) + "\n"


def _describe_entry(entry: TypeEntry) -> str:
    parts = [f"From plugin {_origin(entry.plugin)}."]
    if doc := _doc(entry.config_class):
        parts.append(doc)
    capabilities = sorted(getattr(entry.config_class, "capabilities", ()))
    if capabilities:
        parts.append(f"Capabilities: {', '.join(capabilities)}.")
    return " ".join(parts)


def _origin(record: PluginRecord) -> str:
    where = f"{record.distribution} {record.version}" if record.distribution else "registered in-process"
    return f"`{record.name}` ({where})"


def _table(config_class: type[Config]) -> list[str]:
    fields = attrs.fields(config_class)
    if not fields:
        return ["No fields."]
    hints = _hints(config_class)
    rows = ["| field | type | default | description |", "| --- | --- | --- | --- |"]
    for attribute in fields:
        cells = [
            f"`{attribute.name}`",
            _type(hints.get(attribute.name, attribute.type)),
            _default(attribute),
            attribute.metadata.get("doc", ""),
        ]
        rows.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    return rows


def _plain_configs(roots: list[type]) -> list[type[Config]]:
    """The non-polymorphic config classes reachable from `roots`' fields, breadth first."""
    found: list[type[Config]] = []
    queue = list(roots)
    seen: set[type] = set()
    while queue:
        config_class = queue.pop(0)
        if config_class in seen:
            continue
        seen.add(config_class)
        if not issubclass(config_class, PolymorphicConfig):
            found.append(config_class)
        hints = _hints(config_class)
        for attribute in attrs.fields(config_class):
            queue += [
                candidate
                for candidate in _classes(hints.get(attribute.name, attribute.type))
                if issubclass(candidate, Config)
                and attrs.has(candidate)
                and not issubclass(candidate, PolymorphicConfig)
            ]
    return found


def _hints(config_class: type) -> dict[str, Any]:
    """The fields' annotations, resolved; an unresolvable one (a name imported only for type checkers) stays text."""
    try:
        return typing.get_type_hints(config_class)
    except Exception:  # noqa: BLE001
        return {}


def _classes(annotation: Any) -> Iterator[type]:
    if isinstance(annotation, type):
        yield annotation
    for argument in typing.get_args(annotation):
        yield from _classes(argument)


def _kind_base(config_class: type[PolymorphicConfig]) -> type[PolymorphicConfig]:
    """The class that declares the kind (MixerConfig for AttentionConfig)."""
    return next(cls for cls in config_class.__mro__ if "kind" in vars(cls))


def _type(annotation: Any) -> str:
    origin, arguments = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is typing.Union or origin is types.UnionType:
        return " | ".join(_type(argument) for argument in arguments)
    if origin is Literal:
        return " | ".join(f"`{_yaml(argument)}`" for argument in arguments)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type(argument) for argument in arguments)}]"
    if isinstance(annotation, type) and issubclass(annotation, PolymorphicConfig) and hasattr(annotation, "kind"):
        if "kind" in vars(annotation):
            return f"[{annotation.kind}](#{_slug(f'kind {annotation.kind}')})"
        return f"`{annotation.__name__}` ({annotation.kind})"
    if isinstance(annotation, type) and issubclass(annotation, Config):
        return f"[{annotation.__name__}](#{_slug(annotation.__name__)})"
    if annotation is Path:
        return "path"
    return getattr(annotation, "__name__", str(annotation))


def _default(attribute: attrs.Attribute) -> str:
    default = attribute.default
    if default is attrs.NOTHING:
        return "required"
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        if default.takes_self:
            return "derived (see description)"
        try:
            default = default.factory()
        except ConfigError:
            return "the kind's default type"
    if isinstance(default, Config):
        default = to_dict(default, explicit_only=True)
    return f"`{_yaml(default)}`"


def _yaml(value: Any) -> str:
    """`value` as one line of YAML, as a user writes it in a config."""
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


def _doc(cls: type) -> str:
    doc = vars(cls).get("__doc__") or ""
    return " ".join(doc.split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lowercase, punctuation dropped (but - and _), spaces as hyphens."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.lower()).replace(" ", "-")
