"""Converting configs through sections: a format's config to blockzoo's (`import_config`) and back
(`export_config`), every field and key accounted for; a section's weight mappings for a config (`expand_weights`)."""

from __future__ import annotations

import typing
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from blockzoo.config import Config, PolymorphicConfig
from blockzoo.conversion.formats import _type_label, _where, section_for
from blockzoo.conversion.mappings import (
    TRAINING_FIELDS,
    ConversionError,
    Nested,
    Section,
    WeightMapping,
    get_path,
    join,
)
from blockzoo.plugins import get_registry


def import_config(
    format: str,
    section: Section,
    data: Mapping[str, Any],
    *,
    types: Mapping[str, str] | None = None,
    path: str = "",
) -> dict[str, Any]:
    """Plain data of `section.config_class` (structure it) from the format's config `data`.

    `types`: the registered type name of each part the format chooses per layer (e.g. {"mlp": "moe"}).
    """
    types = types or {}
    result: dict[str, Any] = {}
    if issubclass(section.config_class, PolymorphicConfig):
        result["type"] = get_registry().name_of(section.config_class)
    for mapping in section.config:
        try:
            values = mapping.for_format(format).import_values(data)
        except ConversionError as error:
            raise ConversionError(f"{_where(path)}{error}") from None
        for field_path, value in values.items():
            _set_path(result, field_path, value, path)
    for part in section.parts:
        name = part.type or types.get(part.field)
        if name is None:
            raise ConversionError(f"{_where(path)}the {format} format gives no type for `{part.field}`")
        kind = _field_kind(section.config_class, part.field)
        config_class = get_registry().resolve(kind, name).config_class
        nested_types = {
            key[len(part.field) + 1 :]: value for key, value in types.items() if key.startswith(f"{part.field}.")
        }
        value = import_config(
            format,
            section_for(format, config_class, join(path, part.field)),
            data,
            types=nested_types,
            path=join(path, part.field),
        )
        _set_path(result, part.field, value, path)
    return result


def export_config(
    format: str, config: Config, *, section: Section | None = None, path: str = "", claimed: Iterable[str] = ()
) -> dict[str, Any]:
    """The format's config keys for `config`, through `section` (default: the one registered for its class).

    Every field that describes the architecture must be claimed (by the section, or by the caller in `claimed`),
    and a key written twice must have one value.
    """
    section = section or section_for(format, type(config), path)
    if unclaimed := unclaimed_fields(section, config, claimed):
        fields = ", ".join(f"`{join(path, field)}`" for field in unclaimed)
        raise ConversionError(
            f"the {format} conversion of {_type_label(type(config))} does not handle {fields}: nothing would write "
            "it (a section must claim every field)"
        )
    result: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for mapping in section.config:
        try:
            values = mapping.for_format(format).export_values(config)
        except ConversionError as error:
            raise ConversionError(f"{_where(path)}{error} ({format} format)") from None
        merge_keys(result, origins, values, path or "the model")
    for part in section.parts:
        value = get_path(config, part.field)
        part_path = join(path, part.field)
        if part.type is not None:
            name = get_registry().name_of(type(value)) if isinstance(value, PolymorphicConfig) else repr(value)
            if name != part.type:
                raise ConversionError(
                    f"{_where(part_path)}type {name!r} cannot be written in the {format} format (only {part.type!r})"
                )
        merge_keys(result, origins, export_config(format, value, path=part_path), part_path)
    return result


def merge_keys(result: dict[str, Any], origins: dict[str, str], values: Mapping[str, Any], origin: str) -> None:
    """Add `values` to `result`; a key already there must have the same value (`origins` says who wrote what)."""
    for key, value in values.items():
        if key in result and result[key] != value:
            raise ConversionError(
                f"`{key}` would be {result[key]!r} for {origins[key]} but {value!r} for {origin}; the format has one "
                "value for both"
            )
        result[key] = value
        origins.setdefault(key, origin)


def expand_weights(
    format: str, config: Config, *, ours: str = "", theirs: str | None = None, section: Section | None = None
) -> list[WeightMapping]:
    """Every weight mapping of `config` with full names: parameters under `ours`, tensors under `theirs` (None:
    the section's `name`), `Nested` mappings expanded through their own sections."""
    section = section or section_for(format, type(config), ours)
    prefix = section.name if theirs is None else theirs
    mappings: list[WeightMapping] = []
    for mapping in section.weights(config) if section.weights is not None else ():
        if isinstance(mapping, Nested):
            nested = section_for(format, type(mapping.config), join(ours, mapping.ours))
            nested_theirs = mapping.theirs if mapping.theirs is not None else nested.name
            mappings += expand_weights(
                format,
                mapping.config,
                ours=join(ours, mapping.ours),
                theirs=join(prefix or "", nested_theirs or ""),
                section=nested,
            )
        else:
            mappings.append(mapping.prefixed(ours, prefix or ""))
    return mappings


def _set_path(data: dict[str, Any], field_path: str, value: Any, where: str) -> None:
    *parents, last = field_path.split(".")
    node = data
    for step in parents:
        node = node.setdefault(step, {})
    if last in node and node[last] != value:
        raise ConversionError(
            f"{_where(join(where, field_path))}two mappings give different values ({node[last]!r} and {value!r})"
        )
    node[last] = value


def unclaimed_fields(section: Section, config: Config, claimed: Iterable[str] = ()) -> list[str]:
    """Fields of `config` (dotted paths) that describe the architecture and that neither `section` nor `claimed`
    claims. A claimed path covers what is below it; a polymorphic sub-config must be claimed as a whole (its type is
    architecture too)."""
    return list(_unclaimed_fields(config, section.claimed_fields | set(claimed)))


def _unclaimed_fields(config: Config, claimed: frozenset[str], prefix: str = "") -> Iterable[str]:
    for attribute in attrs.fields(type(config)):
        path = join(prefix, attribute.name)
        if path in claimed or attribute.name in TRAINING_FIELDS:
            continue
        value = getattr(config, attribute.name)
        if isinstance(value, Config) and not isinstance(value, PolymorphicConfig):
            yield from _unclaimed_fields(value, claimed, path)
        else:
            yield path


def _field_kind(config_class: type, field_path: str) -> str:
    """The config kind (`mixer`, `normalization`, ...) a field of a config class holds, from its annotation."""
    owner = config_class
    for step in field_path.split("."):
        annotation = typing.get_type_hints(owner)[step]
        candidates = [annotation, *typing.get_args(annotation)]
        owner = next(
            (c for c in candidates if isinstance(c, type) and issubclass(c, Config)),
            None,
        )
        if owner is None:
            raise TypeError(f"{config_class.__name__}.{field_path} does not hold a config")
    if not issubclass(owner, PolymorphicConfig):
        raise TypeError(f"{config_class.__name__}.{field_path} is not a polymorphic config: it needs no Part")
    return owner.kind
