"""The conformance checks of a converter section (`ConverterSectionConformance`)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from typing import Any, ClassVar

import attrs
import torch

from blockzoo.config import Config, ConfigError, structure, to_dict
from blockzoo.conversion import (
    TRAINING_FIELDS,
    ConversionError,
    Ignored,
    Section,
    claimed_keys,
    expand_weights,
    export_config,
    import_config,
    sections,
    unclaimed_fields,
)
from blockzoo.distributed.runtime import Distributed
from blockzoo.plugins import TypeEntry, get_registry
from blockzoo_testing.conformance.base import _fail
from blockzoo_testing.runs import build, single_process


class ConverterSectionConformance:
    """The conformance checks of a converter section: how a plugin's config class is written in one checkpoint
    format (`register_converters`: `register(format_name, Section(...))`, see blockzoo.conversion).

    Subclass it with `kind` (the config's kind: "mixer", "mlp", "normalization", ...), `format_name`, and a
    `config_factory` returning a config of the type that the format can express. It checks the section alone, through
    the core's conversion machinery (no converter plugin needed): it is registered and imports no torch, claims every
    architecture field, its config survives export -> import -> export, every key it writes is claimed, and every
    parameter of the layer is claimed by exactly one weight mapping whose export -> import gives it back bit for bit.
    """

    kind: ClassVar[str]
    format_name: ClassVar[str]
    hidden_size: ClassVar[int] = 16
    # The registered type of each Part the format chooses per layer (e.g. {"mlp": "moe"}), for importing.
    part_types: ClassVar[Mapping[str, str]] = {}
    seed: ClassVar[int] = 1234

    def config_factory(self) -> Mapping[str, Any] | Config:
        """A small config of the section's type that the format can express: plain data with its `type`, or a config."""
        raise NotImplementedError(f"{type(self).__name__} must define config_factory(self)")

    def test_section_is_registered_and_imports_no_torch(self) -> None:
        section = self._section()
        if section.config_class is not type(self._config()):
            _fail(f"the section's config_class is {section.config_class.__name__}, not {type(self._config()).__name__}")
        script = (
            "import sys\n"
            "from blockzoo.conversion import sections\n"
            f"sections({self.format_name!r})\n"
            "if 'torch' in sys.modules:\n"
            "    raise SystemExit('loading the sections imported torch')\n"
        )
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environment)
        if result.returncode:
            _fail(
                f"{(result.stderr.strip().splitlines() or ['failed'])[-1]}: sections are loaded with the plugins, "
                "which must not import torch (weight mappings import it only when they run)"
            )

    def test_every_architecture_field_is_claimed(self) -> None:
        section, config = self._section(), self._config()
        if unclaimed := unclaimed_fields(section, config):
            _fail(
                f"the {self.format_name} section of {type(config).__name__} claims no mapping for "
                f"{', '.join(unclaimed)}: add one (Rename, Computed; Constant for a value the format implies; "
                "Ignored(ours=..., reason=...) for what it does not hold), or a Part for a sub-config with its own "
                "section. A field nothing writes would be lost in every export."
            )

    def test_config_round_trip(self) -> None:
        section, config = self._section(), self._config()
        exported = self._export(config)
        imported = import_config(self.format_name, section, exported, types=dict(self.part_types))
        try:
            again = structure(imported, type(config))
        except ConfigError as error:
            _fail(f"importing the exported keys gives a config that does not structure: {error}")
        if (exported_again := self._export(again)) != exported:
            _fail(
                f"export -> import -> export changes the format's config:\n  {exported}\n  {exported_again}\n"
                "Each mapping's import must invert its export."
            )
        converted = {path for mapping in section.config if not isinstance(mapping, Ignored) for path in mapping.ours}
        for path in sorted(converted | {part.field for part in section.parts}):
            before, after = _value_at(config, path), _value_at(again, path)
            if not _same_architecture(after, before):
                _fail(
                    f"`{path}` is {before!r}, but {after!r} after export and import: the mapping that claims it must "
                    "convert it both ways (or be Ignored, with the reason)"
                )

    def test_exported_keys_are_claimed(self) -> None:
        exported = self._export(self._config())
        unclaimed = sorted(set(exported) - claimed_keys(self.format_name))
        if unclaimed:
            _fail(
                f"the export writes {', '.join(unclaimed)}, which no {self.format_name} section claims: name each in "
                "its mapping's `theirs`, else importing such a checkpoint is refused (every key must be claimed)"
            )

    def test_weights_round_trip(self) -> None:
        config = self._config()
        layer = build(self._entry().load_implementation(), config, self.hidden_size, self._distributed())
        generator = torch.Generator().manual_seed(self.seed)
        parameters = {
            name: parameter.detach() + torch.randn(parameter.shape, generator=generator)
            for name, parameter in layer.named_parameters()
        }
        mappings = expand_weights(self.format_name, config, ours="", section=self._section())
        claimed = [name for mapping in mappings for name in mapping.ours]
        if unknown := sorted(set(claimed) - set(parameters)):
            _fail(f"weight mappings name {', '.join(unknown)}, not parameters of the layer ({', '.join(parameters)})")
        if twice := sorted({name for name in claimed if claimed.count(name) > 1}):
            _fail(f"parameters {', '.join(twice)} are claimed by several weight mappings")
        if missing := sorted(set(parameters) - set(claimed)):
            _fail(
                f"parameters {', '.join(missing)} are in no weight mapping of the {self.format_name} section: add a "
                "Weight, Concatenated, ComputedWeights or Nested for each, else exports lose them"
            )
        tensors: dict[str, torch.Tensor] = {}
        for mapping in mappings:
            exported = mapping.export_tensors([parameters[name] for name in mapping.ours])
            if len(exported) != len(mapping.theirs):
                _fail(f"the mapping of {mapping.ours} exports {len(exported)} tensors for {len(mapping.theirs)} names")
            for name, tensor in zip(mapping.theirs, exported):
                if name in tensors:
                    _fail(f"tensor {name!r} is written by two weight mappings")
                tensors[name] = tensor
        for mapping in mappings:
            restored = mapping.import_tensors([tensors[name] for name in mapping.theirs])
            for name, tensor in zip(mapping.ours, restored, strict=True):
                if tensor.shape != parameters[name].shape or not torch.equal(tensor, parameters[name]):
                    _fail(
                        f"parameter {name!r} does not come back bit for bit through export and import of its mapping "
                        f"to {', '.join(mapping.theirs)}: the import must invert the export"
                    )

    def _data(self) -> dict[str, Any]:
        factory = self.config_factory()
        return to_dict(factory) if isinstance(factory, Config) else dict(factory)

    def _entry(self) -> TypeEntry:
        data = self._data()
        if "type" not in data:
            _fail(f"config_factory returned {data!r}: give the type, e.g. {{'type': 'myplugin.my_mixer', ...}}")
        return get_registry(strict=False).resolve(self.kind, data["type"])

    def _config(self) -> Config:
        try:
            return structure(self._data(), self._entry().config_class)
        except ConfigError as error:
            _fail(f"config_factory()'s config does not structure: {error}")

    def _section(self) -> Section:
        config_class = type(self._config())
        found = sections(self.format_name).get(config_class)
        if found is None:
            _fail(
                f"no section converts {config_class.__name__} in the {self.format_name!r} format: register one from "
                f"the plugin's `register_converters` hook: register({self.format_name!r}, Section(config_class="
                f"{config_class.__name__}, ...))"
            )
        return found

    def _export(self, config: Config) -> dict[str, Any]:
        try:
            return export_config(self.format_name, config, section=self._section())
        except ConversionError as error:
            _fail(f"exporting config_factory()'s config fails: {error}")

    def _distributed(self) -> Distributed:
        return single_process(self.seed)


def _value_at(config: Config, path: str) -> Any:
    """The value of a dotted field path; None below a field that is None."""
    value: Any = config
    for step in path.split("."):
        value = None if value is None else getattr(value, step)
    return value


def _same_architecture(first: Any, second: Any) -> bool:
    """Equal, sub-configs compared on what they convert (training settings are not written)."""
    if isinstance(first, Config) and isinstance(second, Config):
        return type(first) is type(second) and all(
            _same_architecture(getattr(first, attribute.name), getattr(second, attribute.name))
            for attribute in attrs.fields(type(first))
            if attribute.name not in TRAINING_FIELDS
        )
    return first == second
