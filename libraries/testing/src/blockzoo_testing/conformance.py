"""The conformance kit: base test classes that check a mixer or MLP plugin against blockzoo's layer contract.

A plugin author subclasses one in a test module and provides a small config of the plugin's type::

    from blockzoo_testing import MixerConformance

    class TestGatedConv(MixerConformance):
        def config_factory(self):
            return {"type": "shortconv.gated_conv", "channels": 16, "kernel_size": 3}

pytest then runs every inherited `test_*` method on it. Each failure says what is wrong and what to change.
Options are class attributes (`hidden_size`, `lengths`, `tolerance`, `tensor_parallel_sizes`, `field_changes`,
`field_exceptions`, `seed`); see `LayerConformance`. The checks (docs/plugins/write-a-mixer.md lists them):

- discovery: the type is registered by an installed distribution through its `blockzoo.plugins` entry point, its
  implementation is a `Mixer` / `MLP`, `plugin_info` lists the type's capabilities;
- config: plain data ↔ config round trip (also through YAML), unknown keys refused, every field documented, the
  default config builds, the config and hook modules import no torch;
- the layer: output shape and dtype (fp32 and bf16), construction on the meta device then `materialize`, packed
  documents equal separate runs (outputs and gradients), a padded batch (what CUDA graphs run) equals the exact one,
  every config field changes the parameters or the outputs, every trainable parameter receives a gradient, the layer
  survives deepcopy, .to(dtype), .to("meta") and a state_dict round trip;
- declared capabilities: `tensor_parallel` (and `sequence_tensor_parallel`) on gloo ranks against one process,
  outputs and every gradient; `generation_cache`: prefill then token by token equals the full forward;
  `sequence_data_parallel`: the batch cut into slices run one after the other (`forward_slice`, carries passed on)
  equals the whole forward, and split over 2 and 4 gloo ranks (with and without micro-sequences) equals one process,
  on generated batches whose every slice continues a document (`blockzoo_testing.layouts`);
- a model using the layer survives a checkpoint save / load; `flops` is reported and scales with the tokens.

The pieces these checks are made of serve a plugin's own tests too: `blockzoo_testing.layers` (build a layer, run
it, compare it) and `blockzoo_testing.parallel` (`check_tensor_parallel` on many cases at once).
"""

from __future__ import annotations

import copy
import importlib.metadata
import math
import os
import subprocess
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from types import UnionType
from typing import Any, ClassVar, Literal

import attrs
import pytest
import torch
import yaml

import blockzoo
from blockzoo.config import Config, ConfigError, PolymorphicConfig, merge, structure, to_dict
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
from blockzoo.errors import PluginError
from blockzoo.layers.base import MLP, Batch, Layer, Mixer
from blockzoo.layers.config import GENERATION_CACHE, SEQUENCE_DATA_PARALLEL, TENSOR_PARALLEL, MixerConfig, MLPConfig
from blockzoo.layers.parameter import materialize
from blockzoo.plugins import ENTRY_POINT_GROUP, TypeEntry, get_registry
from blockzoo_testing.layers import (
    ConformanceError,
    LayerSignature,
    _build,
    _mismatch,
    check_decoding,
    check_forward_slices,
    check_packed_documents,
    check_padded_batch,
    layer_inputs,
    layer_signature,
    single_process,
)
from blockzoo_testing.parallel import check_sequence_data_parallel, check_tensor_parallel

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _fail(message: str) -> typing.NoReturn:
    raise ConformanceError(message)


class LayerConformance:
    """Checks shared by mixers and MLPs. Subclass `MixerConformance` or `MLPConformance`, not this."""

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

    # -- discovery and config ----------------------------------------------------------------------------------------

    def test_discovered_through_its_entry_point(self) -> None:
        entry = self._entry()
        record = entry.plugin
        if record.distribution is None:
            _fail(
                f"{self.kind} type {entry.name!r} is registered by plugin {record.name!r}, which no installed "
                f"distribution provides (it was registered in-process). Install your distribution (`pip install -e .`) "
                f'with the entry point `[project.entry-points."{ENTRY_POINT_GROUP}"] {record.name} = '
                '"<package>.plugin"` in its pyproject.toml.'
            )
        declared = [
            entry_point
            for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP, name=record.name)
            if entry_point.dist is not None and entry_point.dist.name == record.distribution
        ]
        if not declared:
            _fail(
                f"{record.distribution} registers {entry.name!r} but declares no {ENTRY_POINT_GROUP!r} entry point "
                f"named {record.name!r}; reinstall it after fixing its pyproject.toml"
            )
        if record.conflicts:
            _fail(f"plugin {record.label} conflicts with another plugin over {', '.join(record.conflicts)}: rename")
        implementation = self._implementation(entry)
        if not (isinstance(implementation, type) and issubclass(implementation, self.layer_base)):
            _fail(
                f"the implementation {entry.implementation!r} of {entry.name!r} is {implementation!r}; it must be a "
                f"subclass of blockzoo.api.{self.layer_base.__name__}, built as Impl(config, *, name, hidden_dim, "
                "distributed, lr_scale)"
            )
        if record.info is None:
            _fail(
                f"plugin {record.label} has no plugin_info hook: add `@hookimpl def plugin_info(): return "
                "PluginInfo(capabilities=..., description=...)` to its hook module (it reports the plugin API version "
                "it was written for)"
            )
        missing = sorted(entry.config_class.capabilities - set(record.info.capabilities))
        if missing:
            _fail(
                f"{entry.config_class.__name__} declares {', '.join(missing)} but plugin_info().capabilities of "
                f"{record.label} does not list it; `blockzoo plugins` shows plugin_info's list: return "
                f"PluginInfo(capabilities=tuple(sorted({entry.config_class.__name__}.capabilities)), ...)"
            )

    def test_config_round_trip(self) -> None:
        config = self._config()
        data = to_dict(config)
        again = self._structure(data, "the data of to_dict(config)")
        if again != config:
            _fail(
                f"structure(to_dict(config)) differs from config:\n  {again!r}\n  {config!r}\n"
                "Every field must survive plain data: use blockzoo field types (int, float, bool, str, Literal, "
                "configs, lists, dicts) and no state outside the attrs fields."
            )
        if yaml.safe_load(yaml.safe_dump(data)) != data:
            _fail(f"to_dict(config) does not survive YAML (checkpoints store config.yaml): {data!r}")
        explicit = self._structure(to_dict(config, explicit_only=True), "to_dict(config, explicit_only=True)")
        if explicit != config:
            _fail(f"the explicit fields alone do not give the config back:\n  {explicit!r}\n  {config!r}")
        self._structure({"type": self._entry().name}, "the default config (`blockzoo plugins --check` builds it)")

    def test_unknown_keys_are_rejected(self) -> None:
        data = {**self._data(), "no_such_field": 1}
        try:
            structure(data, self.kind_config)
        except ConfigError as error:
            if not any(path == "no_such_field" and "unknown key" in message for path, message in error.errors):
                _fail(f"an unknown key was refused, but not by name: {error}")
            return
        _fail(
            "a config with an unknown key `no_such_field` was accepted: declare the config class with "
            "blockzoo.api.configclass and its fields with blockzoo.api.field (blockzoo's converter refuses unknown "
            "keys)"
        )

    def test_every_field_is_documented(self) -> None:
        config_class = type(self._config())
        undocumented = [f.name for f in attrs.fields(config_class) if not f.metadata.get("doc")]
        if undocumented:
            _fail(
                f"fields of {config_class.__name__} without a doc: {', '.join(undocumented)}. Declare each with "
                '`field(default, doc="...")`: `blockzoo config schema` prints the doc in the config reference.'
            )

    def test_config_and_hook_modules_import_no_torch(self) -> None:
        entry = self._entry()
        modules = [entry.config_class.__module__]
        if entry.plugin.module is not None and hasattr(entry.plugin.module, "__name__"):
            modules.append(entry.plugin.module.__name__)
        script = (
            "import importlib, sys\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            "    if 'torch' in sys.modules:\n"
            "        raise SystemExit(f'importing {name} imported torch')\n"
        )
        # The modules this process can import (an uninstalled src layout, a test directory) are importable there too.
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
        result = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=environment
        )
        if result.returncode:
            _fail(
                f"{result.stderr.strip().splitlines()[-1] if result.stderr.strip() else 'failed'}. A plugin's config "
                "and hook modules must not import torch: blockzoo imports them to list plugins and validate configs. "
                "Import torch only in the layer module that the 'module:Class' implementation string names."
            )

    # -- the layer on one process ------------------------------------------------------------------------------------

    def test_output_shape_and_dtype(self) -> None:
        for dtype_name, dtype in _DTYPES.items():
            layer = self._build(self._config(), self._single_process(dtype_name))
            for name, parameter in layer.named_parameters():
                if parameter.dtype != torch.float32:
                    _fail(f"parameter {name!r} is {parameter.dtype}: master weights are fp32 (cast in forward)")
            for lengths in (self.lengths, (1,)):
                hidden = self._inputs(sum(lengths))[0].to(dtype)
                with torch.no_grad():
                    output = layer(hidden, Batch(lengths))
                expected = (sum(lengths), self.hidden_size)
                if not isinstance(output, torch.Tensor) or tuple(output.shape) != expected:
                    shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
                    _fail(
                        f"the output of a batch of documents {list(lengths)} has shape {shape}, expected {expected} = "
                        "[tokens, hidden]: a layer returns one hidden-size vector for each token it receives (project "
                        "back to the hidden size, e.g. with an output Linear to `hidden_dim`)"
                    )
                if output.dtype != dtype:
                    _fail(
                        f"{dtype} input gave a {output.dtype} output: compute in the input's dtype (cast weights with "
                        "`.to(hidden.dtype)`, as Linear does) and return it"
                    )
                if not bool(torch.isfinite(output).all()):
                    _fail(f"the {dtype} output of documents {list(lengths)} is not finite")

    def test_meta_device_construction(self) -> None:
        config = self._config()
        distributed = self._single_process()
        direct = self._build(config, distributed)
        meta_distributed = self._single_process()
        meta_distributed.device = torch.device("meta")
        try:
            with torch.device("meta"):
                lazy = self._build(config, meta_distributed)
        except Exception as error:  # noqa: BLE001
            _fail(
                f"building the layer on the meta device failed ({type(error).__name__}: {error}): a layer's __init__ "
                "creates parameters (on `distributed.device`) and computes nothing from tensor values"
            )
        allocated = [name for name, tensor in [*lazy.named_parameters(), *lazy.named_buffers()] if not tensor.is_meta]
        if allocated:
            _fail(
                f"built on the meta device, {', '.join(allocated)} still got memory: create every tensor on "
                "`distributed.device` (create_parameter and Linear do), so a large model can be built without memory "
                "and materialized shard by shard"
            )
        without_meta = [name for name, parameter in lazy.named_parameters() if not hasattr(parameter, "meta")]
        if without_meta:
            _fail(
                f"parameters {', '.join(without_meta)} were not made by blockzoo's parameter factory (no `.meta`): "
                "make every parameter with blockzoo.api.create_parameter or Linear, so it is initialized reproducibly, "
                "split between tensor-parallel ranks and checkpointed as a global tensor"
            )
        constants = [
            f"{module_name}.{attribute}" if module_name else attribute
            for module_name, module in lazy.named_modules()
            for attribute, value in vars(module).items()
            if isinstance(value, torch.Tensor)  # parameters and buffers live in their own dicts, not in vars()
        ]
        if constants:
            plural = len(constants) > 1
            _fail(
                f"tensor attribute{'s' if plural else ''} {', '.join(constants)} (not a parameter) "
                f"{'were' if plural else 'was'} computed in __init__: built on the meta device (as a large or sharded "
                "model is) it holds no values, and moving the model to a device leaves it behind. Keep constants as "
                "Python numbers in __init__, or compute it in forward from the config (cached per batch with "
                "batch.preprocessed(key, compute)); a value to train or checkpoint is a parameter (create_parameter)"
            )
        buffers = [name for name, _ in lazy.named_buffers()]
        if buffers:
            _fail(
                f"buffers {', '.join(buffers)} are not restored by materialize: compute constant tensors in forward "
                "(cached with batch.preprocessed) instead of registering buffers"
            )
        materialize(lazy, distributed)
        for (name, parameter), expected in zip(lazy.named_parameters(), direct.parameters(), strict=True):
            if not torch.equal(parameter, expected):
                _fail(
                    f"parameter {name!r} materialized from the meta device differs from a direct build: initialize "
                    "only through create_parameter's settings (its initialization runs again in materialize)"
                )
        hidden, _ = self._inputs(sum(self.lengths))
        with torch.no_grad():
            self._assert_close(
                lazy(hidden, Batch(self.lengths)),
                direct(hidden, Batch(self.lengths)),
                "the output of the materialized layer",
                "keep no state outside parameters created by the factory",
            )

    def test_survives_module_transforms(self) -> None:
        """What torch users do to any module: copy it, cast it, move it, save and load its state."""
        layer = self._build(self._config())
        hidden, _ = self._inputs(sum(self.lengths))
        with torch.no_grad():
            expected = layer(hidden, Batch(self.lengths))
        copied = _transformed("copy.deepcopy(layer)", copy.deepcopy, layer)
        for dtype in (torch.float64, torch.float32):  # fp32 -> fp64 -> fp32 is exact
            copied = _transformed(f".to({dtype})", lambda module, dtype=dtype: module.to(dtype), copied)
            if wrong := [name for name, p in copied.named_parameters() if p.is_floating_point() and p.dtype != dtype]:
                _fail(f"after .to({dtype}), parameters {', '.join(wrong)} are not {dtype}")
        with torch.no_grad():
            self._assert_close(
                copied(hidden, Batch(self.lengths)),
                expected,
                "the output of the layer deep-copied and cast to fp64 and back",
                "keep all state in parameters (a copy holds them; casts convert them)",
            )
        on_meta = _transformed('.to("meta")', lambda module: module.to("meta"), copied)
        if left := [
            name for name, tensor in [*on_meta.named_parameters(), *on_meta.named_buffers()] if not tensor.is_meta
        ]:
            _fail(f'after .to("meta"), {", ".join(left)} are not on the meta device: keep tensors as parameters')
        other = self._build(self._config(), single_process(self.seed + 1))  # other initial weights
        _transformed("load_state_dict(state_dict())", lambda module: module.load_state_dict(layer.state_dict()), other)
        with torch.no_grad():
            self._assert_close(
                other(hidden, Batch(self.lengths)),
                expected,
                "the output of a second build loaded with the layer's state_dict",
                "every value the forward uses must be in state_dict (a parameter)",
            )

    def test_packed_documents_equal_separate_runs(self) -> None:
        check_packed_documents(self._build(self._config()), lengths=self.lengths, tolerance=self.tolerance)

    def test_padded_batches_equal_exact_ones(self) -> None:
        check_padded_batch(self._build(self._config()), lengths=self.lengths, tolerance=self.tolerance)

    def test_gradients_reach_every_parameter(self) -> None:
        layer = self._build(self._config())
        hidden, weights = self._inputs(sum(self.lengths))
        hidden.requires_grad_()
        batch = Batch(self.lengths)
        loss = (layer(hidden, batch) * weights).sum() + sum(batch.losses.values(), torch.zeros(()))
        loss.backward()
        for name, parameter in layer.named_parameters():
            if parameter.requires_grad and (parameter.grad is None or not bool(parameter.grad.any())):
                _fail(
                    f"parameter {name!r} received no gradient from a loss on the output: it is unused, or detached "
                    "(.detach(), .data, torch.no_grad) in forward. Remove it, use it, or freeze it (lr_scale 0)"
                )
        if hidden.grad is None or not bool(hidden.grad.any()):
            _fail("the input received no gradient: the output must depend on the input differentiably")

    def test_every_field_changes_something(self) -> None:
        config_class = type(self._config())
        names = {f.name for f in attrs.fields(config_class)}
        for option in ("field_exceptions", "field_changes"):
            unknown = set(getattr(self, option)) - names
            if unknown:
                _fail(f"{option} names {', '.join(sorted(unknown))}, not fields of {config_class.__name__}")
        empty = [name for name, reason in self.field_exceptions.items() if not str(reason).strip()]
        if empty:
            _fail(f"field_exceptions needs a reason for {', '.join(empty)}")
        base = self._signature(self._config())
        if self._signature(self._config()).differs_from(base, self.tolerance):
            _fail(
                "two builds of the same config differ: initialize only through create_parameter (seeded by the run's "
                "seed and the parameter's name) and draw randomness in forward only from torch's seeded generators"
            )
        attrs.resolve_types(config_class)
        problems = []
        for attribute in attrs.fields(config_class):
            if attribute.name in self.field_exceptions:
                continue
            if attribute.name in self.field_changes:
                changes = [self.field_changes[attribute.name]]
            else:
                value = getattr(self._config(), attribute.name)
                changes = [{attribute.name: change} for change in _candidate_changes(attribute.type, value)]
            if not changes:
                problems.append(
                    f"{attribute.name}: the kit cannot derive a change for a field of type {attribute.type}; give one "
                    f'in field_changes = {{"{attribute.name}": {{"{attribute.name}": ...}}}}'
                )
                continue
            outcome = self._first_change_that_shows(changes, base)
            if outcome is not None:
                problems.append(f"{attribute.name}: {outcome}")
        if problems:
            _fail(
                f"these fields of {config_class.__name__} changed neither the parameters nor the output:\n"
                + "\n".join(f"  - {problem}" for problem in problems)
                + "\nEvery declared field must change the layer. Use the field, or remove it; a field that acts only "
                "where one process cannot show it goes in `field_exceptions = {name: reason}`; a change that needs "
                "other fields goes in `field_changes = {name: {...}}`."
            )

    def _first_change_that_shows(self, changes: list[Mapping[str, Any]], base: LayerSignature) -> str | None:
        """None when one of `changes` changes the layer, else what was tried."""
        tried = []
        for change in changes:
            try:
                config = structure(merge(self._data(), change), self.kind_config)
            except ConfigError as error:
                tried.append(f"{_show(change)} is refused ({'; '.join(message for _, message in error.errors)})")
                continue
            try:
                signature = self._signature(config)
            except Exception as error:  # noqa: BLE001 - a change this process cannot run shows nothing here
                tried.append(f"{_show(change)} does not run here ({type(error).__name__}: {error})")
                continue
            if signature.differs_from(base, self.tolerance):
                return None
            tried.append(f"{_show(change)} changed nothing")
        shown = 3
        more = f"; and {len(tried) - shown} more changes" if len(tried) > shown else ""
        return "; ".join(tried[:shown]) + more

    # -- declared capabilities ---------------------------------------------------------------------------------------

    @pytest.mark.distributed
    def test_tensor_parallel_matches_one_process(self) -> None:
        config = self._config()
        if TENSOR_PARALLEL not in config.capabilities:
            pytest.skip(f"{type(config).__name__} does not declare tensor_parallel")
        for size in self.tensor_parallel_sizes:
            check_tensor_parallel(
                self.kind_config,
                {"config_factory()": config},
                hidden_size=self.hidden_size,
                lengths=self.lengths,
                tolerance=self.tolerance,
                tensor_parallel=size,
                seed=self.seed,
            )

    def test_forward_slices_equal_the_whole_forward(self) -> None:
        config = self._config()
        if SEQUENCE_DATA_PARALLEL not in config.capabilities:
            pytest.skip(f"{type(config).__name__} does not declare sequence_data_parallel")
        layer = self._build(config)
        for length in self.slice_lengths:
            check_forward_slices(layer, lengths=self.lengths, slice_length=length, tolerance=self.tolerance)

    @pytest.mark.distributed
    def test_sequence_data_parallel_matches_one_process(self) -> None:
        config = self._config()
        if SEQUENCE_DATA_PARALLEL not in config.capabilities:
            pytest.skip(f"{type(config).__name__} does not declare sequence_data_parallel")
        # Not `lengths`: generated batches whose every slice continues a document (blockzoo_testing.layouts), all
        # sizes in one set of processes.
        check_sequence_data_parallel(
            self.kind_config,
            {"config_factory()": config},
            hidden_size=self.hidden_size,
            tolerance=self.tolerance,
            sequence_data_parallel=self.sequence_data_parallel_sizes,
            micro_sequence_lengths=self.micro_sequence_lengths,
            seed=self.seed,
        )

    def test_generation_equals_the_full_forward(self) -> None:
        config = self._config()
        if GENERATION_CACHE not in config.capabilities:
            pytest.skip(f"{type(config).__name__} does not declare generation_cache")
        check_decoding(self._build(config), tolerance=self.tolerance)

    # -- in a model --------------------------------------------------------------------------------------------------

    def test_checkpoint_round_trip(self, tmp_path: Path) -> None:
        other = {"type": "none"}
        block = {"mixer": self._data(), "mlp": other} if self.kind == "mixer" else {"mixer": other, "mlp": self._data()}
        run_config = {
            "model": {
                "hidden_size": self.hidden_size,
                "embeddings": {"vocab_size": 32},
                "decoder": {"type": "fixed", "num_blocks": 2, "block": block},
            },
            "distributed": {"seed": self.seed, "backend": "gloo"},
        }
        distributed = self._single_process()
        model = blockzoo.build(run_config, distributed=distributed)
        generator = torch.Generator().manual_seed(self.seed)
        with torch.no_grad():  # Away from the initialization, which a fresh build would give back anyway.
            for parameter in model.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)
        blockzoo.save(model, tmp_path / "checkpoint")
        loaded = blockzoo.load(tmp_path / "checkpoint", distributed=distributed)
        if to_dict(loaded.config) != to_dict(model.config):
            _fail("the model config read back from the checkpoint differs from the saved one")
        loaded_parameters = dict(loaded.named_parameters())
        for name, parameter in model.named_parameters():
            if name not in loaded_parameters or not torch.equal(loaded_parameters[name], parameter):
                _fail(
                    f"parameter {name!r} did not survive a checkpoint save and load: make it with create_parameter or "
                    "Linear under a name that does not depend on the run (it is stored by name as a global tensor)"
                )
        tokens = torch.randint(0, 32, (2, 7), generator=generator)
        with torch.no_grad():
            self._assert_close(loaded(tokens), model(tokens), "the logits of the reloaded model", "")

    def test_flops_are_reported_and_scale_with_tokens(self) -> None:
        layer = self._build(self._config())
        once, twice = layer.flops(Batch(self.lengths)), layer.flops(Batch(list(self.lengths) * 2))
        if not (isinstance(once, tuple) and len(once) == 2 and all(type(value) is int for value in once)):
            _fail(f"flops(batch) returned {once!r}: return (forward, backward) as two Python ints")
        if min(once) <= 0:
            _fail(
                f"flops(batch) returned {once}: count the forward and backward floating-point operations (MFU is "
                "computed from them); Linear.forward_flops / backward_flops count the projections"
            )
        if twice != (2 * once[0], 2 * once[1]):
            _fail(
                f"flops(batch) is {once} for the test batch and {twice} for the batch with every document twice, "
                f"expected exactly {(2 * once[0], 2 * once[1])}: count the whole batch (every document, every "
                "tensor-parallel rank together) from batch.lengths"
            )
        short, long = layer.flops(Batch([4])), layer.flops(Batch([8]))
        if not (long[0] > short[0] and long[1] > short[1]):
            _fail(f"a document of 8 tokens costs {long}, one of 4 costs {short}: more tokens must cost more")

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
        return _build(implementation, config, self.hidden_size, distributed or self._single_process())

    def _inputs(self, tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return layer_inputs(tokens, self.hidden_size, seed)

    def _assert_close(self, actual: torch.Tensor, expected: torch.Tensor, what: str, fix: str) -> None:
        problem = _mismatch(actual, expected, self.tolerance, what)
        if problem:
            _fail(f"{problem}. {fix}".rstrip(". ") + ".")

    def _signature(self, config: Config) -> LayerSignature:
        return layer_signature(self._build(config), self.lengths, random_seed=self.seed)


class MixerConformance(LayerConformance):
    """The conformance checks of a mixer plugin (also: decoding with `new_state` when it declares generation_cache)."""

    kind = "mixer"
    kind_config = MixerConfig
    layer_base = Mixer


class MLPConformance(LayerConformance):
    """The conformance checks of an MLP plugin."""

    kind = "mlp"
    kind_config = MLPConfig
    layer_base = MLP


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
        layer = _build(self._entry().load_implementation(), config, self.hidden_size, self._distributed())
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


def _transformed(what: str, transform: typing.Callable[[Any], Any], module: Any) -> Any:
    try:
        return transform(module)
    except Exception as error:  # noqa: BLE001
        _fail(
            f"{what} raised {type(error).__name__}: {error}. A layer must survive torch's module transforms: do not "
            "override nn.Module's methods by accident (a helper named `_apply` hides the one that `.to(...)`, "
            "`.cuda()` and `.double()` call), and keep no state that copying or moving cannot handle"
        )


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


# ---------------------------------------------------------------------------------------------------------------------
# Deriving a change of each config field from its type


def _candidate_changes(annotation: Any, value: Any, depth: int = 0) -> list[Any]:
    """Values (plain data, merged into the config's data) that differ from `value`, most telling first."""
    origin, arguments = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union or origin is UnionType:
        members = [member for member in arguments if member is not type(None)]
        found = [None] if value is not None and len(members) < len(arguments) else []
        for member in members:
            found += _candidate_changes(member, value, depth)
        return _unique(found)
    if origin is Literal:
        return [choice for choice in arguments if choice != value]
    if annotation is bool:
        return [True, False] if value is None else [not value]
    if annotation is int:
        options = [1, 2, 3, 4, 8] if value is None else [2 * value, value + 1, value - 1, 1, 2, 3]
        return [option for option in _unique(options) if option != value]
    if annotation is float:
        if value is None or value == 0:
            options = [0.5, 0.1, 2.0, 1.0]
        elif math.isinf(value):
            options = [1.0, 10.0]
        else:
            options = [2 * value, 0.5 * value, value + 1.0, 0.5, 0.1]
        return [option for option in _unique(options) if option != value]
    if isinstance(annotation, type) and issubclass(annotation, Config) and attrs.has(annotation):
        return _config_changes(annotation, value, depth)
    return []


def _config_changes(annotation: type[Config], value: Any, depth: int) -> list[Any]:
    found: list[Any] = []
    if value is None:
        found.append({})  # The field's defaults (a polymorphic kind's default type).
    if issubclass(annotation, PolymorphicConfig) and hasattr(annotation, "kind"):
        registry = get_registry(strict=False)
        current = registry.name_of(type(value)) if value is not None and registry.is_registered(type(value)) else None
        found += [
            {"type": entry.name}
            for entry in registry.entries(annotation.kind)
            if entry.name != current and issubclass(entry.config_class, annotation)
        ]
    if value is not None and depth < 2:
        nested_class = type(value)
        attrs.resolve_types(nested_class)
        for attribute in attrs.fields(nested_class):
            for change in _candidate_changes(attribute.type, getattr(value, attribute.name), depth + 1):
                found.append({attribute.name: change})
    return found


def _unique(values: list[Any]) -> list[Any]:
    unique: list[Any] = []
    for value in values:
        if not any(value == seen and type(value) is type(seen) for seen in unique):
            unique.append(value)
    return unique


def _show(change: Mapping[str, Any]) -> str:
    return yaml.safe_dump(dict(change), default_flow_style=True, width=1000).strip()
