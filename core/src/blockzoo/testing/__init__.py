"""Helpers for testing blockzoo and its plugins (public: plugin authors use them too).

- The conformance kit (`blockzoo.testing.conformance`): subclass `MixerConformance` or `MLPConformance` (or
  `ConverterSectionConformance` for a checkpoint-format section) in a test module and provide `config_factory`;
  pytest runs the inherited checks.
- What a plugin's own tests share with every other plugin's (`blockzoo.testing.layers`): `single_process(seed)`,
  `build_layer(config, hidden_size, distributed)`, `layer_inputs(tokens, hidden_size)`, `run_layer(...)` ->
  `LayerRun`, `relative_error`, `layer_signature(layer, lengths)` -> `LayerSignature` (`.differs_from(other)`: did
  a config field change the layer?), and the checks `check_packed_documents` (packed documents against each run
  alone), `check_padded_batch` (a CUDA graph's padded batch against the exact one), `check_matches_layer` (the same
  layer elsewhere: CUDA, bf16), `check_decoding` (generation against the
  full forward) and `check_forward_slices` (slices of the documents one after the other against the whole forward).
- `check_tensor_parallel(config_class, cases, ...)` and `check_sequence_data_parallel(config_class, cases, ...)`
  (`blockzoo.testing.parallel`): cases split between gloo ranks against one process, all in one set of processes;
  the second on generated batches whose every slice continues a document (`straddling_lengths`, `layout_problems`:
  `blockzoo.testing.layouts`).
- `run_distributed(world_size, fn, *args)` (`blockzoo.testing.distributed`): gloo ranks on the CPU.
- A tracker plugin's tests (`blockzoo.testing.tracking`): `tiny_run_config(output_dir, *overrides)` (`TINY_RUN`, a
  run of seconds), `train_tiny(config)`, `train_killed_at(config, step)` (a crash after that step's figures were
  logged), `straight_and_resumed(root, *overrides)` (a straight run and one killed after a checkpoint then resumed),
  `logged_figures(output_dir, names)` (its `metrics.jsonl` by step; `DETERMINISTIC` names the figures two runs share).

The names load on first access: importing this package imports no torch (pytest loads `blockzoo.testing.pytest_plugin`
in every run of an environment where blockzoo is installed).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ConformanceError": "blockzoo.testing.layers",
    "ConverterSectionConformance": "blockzoo.testing.conformance",
    "LayerConformance": "blockzoo.testing.conformance",
    "MixerConformance": "blockzoo.testing.conformance",
    "MLPConformance": "blockzoo.testing.conformance",
    "free_port": "blockzoo.testing.distributed",
    "run_distributed": "blockzoo.testing.distributed",
    "LayerRun": "blockzoo.testing.layers",
    "LayerSignature": "blockzoo.testing.layers",
    "build_layer": "blockzoo.testing.layers",
    "check_decoding": "blockzoo.testing.layers",
    "check_forward_slices": "blockzoo.testing.layers",
    "check_matches_layer": "blockzoo.testing.layers",
    "check_packed_documents": "blockzoo.testing.layers",
    "check_padded_batch": "blockzoo.testing.layers",
    "layer_inputs": "blockzoo.testing.layers",
    "layer_signature": "blockzoo.testing.layers",
    "relative_error": "blockzoo.testing.layers",
    "run_layer": "blockzoo.testing.layers",
    "single_process": "blockzoo.testing.layers",
    "check_tensor_parallel": "blockzoo.testing.parallel",
    "check_sequence_data_parallel": "blockzoo.testing.parallel",
    "DETERMINISTIC": "blockzoo.testing.tracking",
    "Killed": "blockzoo.testing.tracking",
    "TINY_RUN": "blockzoo.testing.tracking",
    "logged_figures": "blockzoo.testing.tracking",
    "straight_and_resumed": "blockzoo.testing.tracking",
    "tiny_run_config": "blockzoo.testing.tracking",
    "train_killed_at": "blockzoo.testing.tracking",
    "train_tiny": "blockzoo.testing.tracking",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'blockzoo.testing' has no attribute {name!r}")
