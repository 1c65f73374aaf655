"""What every layer check shares: the options a test class sets, its config, and how it builds and runs the
layer."""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from blockzoo.config import Config, ConfigError, PolymorphicConfig, structure, to_dict
from blockzoo.distributed.runtime import Distributed
from blockzoo.errors import PluginError
from blockzoo.layers.base import Layer
from blockzoo.plugins import TypeEntry, get_registry
from blockzoo_testing.layers import LayerSignature, layer_signature
from blockzoo_testing.runs import ConformanceError, build, layer_inputs, mismatch, single_process

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _fail(message: str) -> typing.NoReturn:
    raise ConformanceError(message)


class ConformanceBase:
    """The options and helpers of the layer checks (`LayerConformance` gathers the checks)."""

    kind: ClassVar[str]
    kind_config: ClassVar[type[PolymorphicConfig]]
    layer_base: ClassVar[type[Layer]]

    # -- options: override as class attributes -----------------------------------------------------------------------
    hidden_size: ClassVar[int] = 16
    # The documents of the packed test batch: a one-token document, lengths that are multiples of nothing in
    # particular, 12 tokens in all so that sequence-tensor-parallel splits them between 2, 3, 4 or 6 ranks.
    lengths: ClassVar[tuple[int, ...]] = (5, 1, 6)
    # fp32 comparisons (packed vs separate, parallel vs single process, decoding vs full forward).
    tolerance: ClassVar[Mapping[str, float]] = {"atol": 1e-5, "rtol": 1e-5}
    # Tensor-parallel sizes checked when the type declares tensor_parallel (one set of gloo processes per size).
    tensor_parallel_sizes: ClassVar[tuple[int, ...]] = (2,)
    # When the type declares sequence_data_parallel: the slice lengths run one after the other in one process (they
    # must divide the tokens of `lengths`; 4 makes documents straddle slices), the sequence-data-parallel sizes on
    # gloo (all in one set of processes) and the micro-sequence lengths checked with them (None: one slice a rank),
    # each pair on its own generated batch whose every slice continues a document (blockzoo_testing.layouts).
    slice_lengths: ClassVar[tuple[int, ...]] = (1, 4, 6)
    sequence_data_parallel_sizes: ClassVar[tuple[int, ...]] = (2, 4)
    micro_sequence_lengths: ClassVar[tuple[int | None, ...]] = (None, 3)
    # Field name -> an update of the config that should change the layer, for fields whose change the kit cannot
    # derive (strings, lists) or that need other fields set with them: {"activation": {"activation": "relu"}}.
    field_changes: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    # Field name -> why no change of it shows in one process (e.g. "picks the kernel; every kernel computes the same").
    field_exceptions: ClassVar[Mapping[str, str]] = {}
    seed: ClassVar[int] = 1234

    def config_factory(self) -> Mapping[str, Any] | Config:
        """A small config of the plugin's type: plain data as in a YAML file (with its `type`), or a config."""
        raise NotImplementedError(
            f"{type(self).__name__} must define config_factory(self) returning a small config of the plugin's type, "
            'e.g. {"type": "myplugin.my_mixer", "channels": 16}'
        )

    # -- helpers -----------------------------------------------------------------------------------------------------

    def _data(self) -> dict[str, Any]:
        factory = self.config_factory()
        if isinstance(factory, Config):
            return to_dict(factory)
        if not isinstance(factory, Mapping) or "type" not in factory:
            _fail(
                f"config_factory returned {factory!r}: return plain data with the plugin's `type` "
                '(e.g. {"type": "myplugin.my_mixer", ...}) or a config object'
            )
        return dict(factory)

    def _structure(self, data: Mapping[str, Any], what: str) -> Config:
        try:
            return structure(data, self.kind_config)
        except (ConfigError, PluginError) as error:  # PluginError: strict mode, a plugin failed to load
            _fail(f"{what} does not structure: {error}")

    def _config(self) -> Config:
        config = self._structure(self._data(), "config_factory()'s config")
        if not isinstance(config, self.kind_config):
            _fail(f"config_factory() gave a {type(config).__name__}, not a {self.kind_config.__name__}")
        return config

    def _entry(self) -> TypeEntry:
        config = self._config()
        registry = get_registry(strict=False)
        return registry.resolve(self.kind, registry.name_of(type(config)))

    def _implementation(self, entry: TypeEntry) -> Any:
        try:
            return entry.load_implementation()
        except Exception as error:  # noqa: BLE001
            _fail(f"the implementation {entry.implementation!r} of {entry.name!r} does not import: {error!r}")

    def _single_process(self, compute_dtype: str = "fp32") -> Distributed:
        return single_process(self.seed, compute_dtype=compute_dtype)

    def _build(self, config: Config, distributed: Distributed | None = None) -> Layer:
        implementation = self._implementation(self._entry())
        return build(implementation, config, self.hidden_size, distributed or self._single_process())

    def _inputs(self, tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return layer_inputs(tokens, self.hidden_size, seed)

    def _assert_close(self, actual: torch.Tensor, expected: torch.Tensor, what: str, fix: str) -> None:
        problem = mismatch(actual, expected, self.tolerance, what)
        if problem:
            _fail(f"{problem}. {fix}".rstrip(". ") + ".")

    def _signature(self, config: Config) -> LayerSignature:
        return layer_signature(self._build(config), self.lengths, random_seed=self.seed)
