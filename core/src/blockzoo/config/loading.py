"""Configs from files and the command line: YAML files with errors giving line and column, `key.path=value`
overrides, merging an update into a config (`load`, `update`, `merge`, `parse_overrides`, `read_yaml`,
`to_yaml`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import yaml

from blockzoo.config.classes import Config, ConfigT, PolymorphicConfig
from blockzoo.config.converter import structure
from blockzoo.config.errors import ConfigError
from blockzoo.config.kinds import _registry
from blockzoo.config.unstructure import to_dict


def merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge `update` into `base`. A node whose `type` changes is replaced, not merged."""
    if "type" in update and "type" in base and update["type"] != base["type"]:
        return dict(update)
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def update(config: ConfigT, changes: Mapping[str, Any], *, source: str | None = None) -> ConfigT:
    """A new config: `config`'s explicit fields with `changes` merged over them. Defaults are re-derived. A part
    whose `type` the changes replace keeps its explicit fields that the new type also has (`data.type=memmap`
    keeps the `sequence_length` the file set for its embedded data); the new type's defaults fill the rest."""
    changes = _carry_over(config, changes)
    return structure(merge(to_dict(config, explicit_only=True), changes), type(config), source=source)


def _carry_over(config: Any, changes: Any) -> Any:
    """`changes`, where one gives a part another `type`, completed with the part's explicit fields that the new type
    also has (the changes' own values first). A type that does not resolve is left for `structure` to report."""
    if not isinstance(changes, Mapping):
        return changes
    if isinstance(config, PolymorphicConfig) and "type" in changes:
        try:
            target = _registry().resolve(config.kind, changes["type"]).config_class
        except Exception:  # noqa: BLE001 - an unknown or malformed type: structure names it at its field
            return changes
        if target is not type(config):
            fields = attrs.fields_dict(target)
            kept = {key: value for key, value in to_dict(config, explicit_only=True).items() if key in fields}
            return {**kept, **changes}
    if isinstance(config, Config):
        return {key: _carry_over(getattr(config, key, None), value) for key, value in changes.items()}
    if isinstance(config, Mapping):  # a mapping of names to configs (a pattern's blocks)
        return {key: _carry_over(config.get(key), value) for key, value in changes.items()}
    return changes


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """Turn `["model.hidden_size=512", ...]` into a nested update. Values are parsed as YAML (typed)."""
    result: dict[str, Any] = {}
    problems = []
    for override in overrides:
        key, separator, raw_value = override.partition("=")
        steps = key.strip().split(".")
        if not separator or not all(steps):
            problems.append((override, "an override must look like `path.to.key=value`"))
            continue
        try:
            value = yaml.safe_load(raw_value)
        except yaml.YAMLError as error:
            problems.append((key, f"cannot parse value {raw_value!r}: {_yaml_problem(error)}"))
            continue
        node = result
        for step in steps[:-1]:
            child = node.setdefault(step, {})
            if not isinstance(child, dict):
                problems.append((key, f"conflicts with the override of {step!r}"))
                break
            node = child
        else:
            node[steps[-1]] = value
    if problems:
        raise ConfigError(problems, "command line")
    return result


def _yaml_problem(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    if mark is not None:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return problem


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping, with errors that give the file, line and column."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError([("", f"cannot read the file: {error.strerror or error}")], str(path)) from error
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError([("", f"malformed YAML at {_yaml_problem(error)}")], str(path)) from error
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([("", f"the file must hold a mapping of keys, found {type(data).__name__}")], str(path))
    return data


def to_yaml(config: Config, *, explicit_only: bool = False) -> str:
    return yaml.safe_dump(to_dict(config, explicit_only=explicit_only), sort_keys=False)


def load(
    cls: type[ConfigT], path: str | Path | None = None, overrides: Sequence[str] = (), *, data: Mapping | None = None
) -> ConfigT:
    """Read a config: a YAML file (or `data`) with `key=value` overrides applied on top."""
    base = read_yaml(path) if path is not None else dict(data or {})
    source = str(path) if path is not None else None
    changes = parse_overrides(overrides)
    try:
        config = structure(base, cls, source=source)
    except ConfigError:
        if not changes:
            raise
        # The overrides may complete an incomplete file.
        return structure(merge(base, changes), cls, source=f"{source} with overrides" if source else "overrides")
    # Applied as an update, so an override of a `type` starts that part from the new type's defaults.
    return update(config, changes, source="command line") if changes else config
