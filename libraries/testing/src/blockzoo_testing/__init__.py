"""Helpers for testing blockzoo and its plugins (public: plugin authors use them too).

- The conformance kit (`blockzoo_testing.conformance`): subclass `MixerConformance` or `MLPConformance` (or
  `ConverterSectionConformance` for a checkpoint-format section) in a test module and provide `config_factory`;
  pytest runs the inherited checks.
- What a plugin's own tests share with every other plugin's (`blockzoo_testing.layers`): `single_process(seed)`,
  `build_layer(config, hidden_size, distributed)`, `layer_inputs(tokens, hidden_size)`, `run_layer(...)` ->
  `LayerRun`, `relative_error`, `layer_signature(layer, lengths)` -> `LayerSignature` (`.differs_from(other)`: did
  a config field change the layer?), and the checks `check_packed_documents` (packed documents against each run
  alone), `check_padded_batch` (a CUDA graph's padded batch against the exact one), `check_matches_layer` (the same
  layer elsewhere: CUDA, bf16), `check_decoding` (generation against the
  full forward) and `check_forward_slices` (slices of the documents one after the other against the whole forward).
- `check_recurrent_slices(layer, ...)` (`blockzoo_testing.recurrence`): a recurrent mixer whose carry is a
  convolution's inputs and a scan's state (the Mamba family's) over slices: the whole forward, a float64 reference,
  and the carry against the generation state; `RecurrentSliceTests`, a base test class running it on a table of
  cases; `forward_over_slices(layer, hidden, lengths, slice_length)` (outputs and last carry, no gradients).
- `check_matches_reference(layer, reference_forward, ...)` (a float64 reference of the plugin's own),
  `check_bf16_compute(layer, fp32_layer, ...)`, `check_generation_refusals(layer)`, `reference_activation(name, x)`,
  `parameter_shapes(layer)`, `parameters_without_weight_decay(layer)` (`blockzoo_testing.numerics`).
- A plugin's config tests (`blockzoo_testing.configs`): `check_config_error(config_class, data, message)` (the
  error names the field by its path), `check_imports_no_torch(*modules)`,
  `check_registered(kind, name, config_class, implementation, capabilities)`.
- A plugin's whole-model tests (`blockzoo_testing.models`): `shortened_example(path, output_dir)` (an example
  config run in seconds), `check_every_parameter_gets_a_gradient(model)`, `check_trains_and_reloads(run_config,
  moved=...)` (the loss falls, the checkpoint reloads), `greedy_by_full_forward(model, prompt, steps)`.
- `CudaComparison(build, seed, output_tolerance, gradient_tolerance)` (`blockzoo_testing.cuda`): a plugin's GPU
  tests, the layer on CUDA against its CPU path (outputs and gradients, slices, decoding, padded batches).
- `check_tensor_parallel(config_class, cases, ...)` and `check_sequence_data_parallel(config_class, cases, ...)`
  (`blockzoo_testing.parallel`): cases split between gloo ranks against one process, all in one set of processes;
  the second on generated batches whose every slice continues a document (`straddling_lengths`, `layout_problems`:
  `blockzoo_testing.layouts`).
- `run_distributed(world_size, fn, *args)` (`blockzoo_testing.distributed`): gloo ranks on the CPU.
- A tracker plugin's tests (`blockzoo_testing.tracking`): `tiny_run_config(output_dir, *overrides)` (`TINY_RUN`, a
  run of seconds), `train_tiny(config)`, `train_killed_at(config, step)` (a crash after that step's figures were
  logged), `straight_and_resumed(root, *overrides)` (a straight run and one killed after a checkpoint then resumed),
  `logged_figures(output_dir, names)` (its `metrics.jsonl` by step; `DETERMINISTIC` names the figures two runs share).
- A plugin's Triton kernels on a machine without a GPU (`blockzoo_testing.triton_interpreter`):
  `run_interpreter_cases(test_file, *arguments)` runs the test file's cases under Triton's interpreter in a
  subprocess, which calls `patch_for_numpy()` first (and `patch_bf16_dots()` where its kernels take bf16 dots).

The names load on first access: importing this package imports no torch (pytest loads `blockzoo_testing.pytest_plugin`
in every run of an environment where blockzoo is installed).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ConformanceError": "blockzoo_testing.runs",
    "ConverterSectionConformance": "blockzoo_testing.conformance",
    "LayerConformance": "blockzoo_testing.conformance",
    "MixerConformance": "blockzoo_testing.conformance",
    "MLPConformance": "blockzoo_testing.conformance",
    "free_port": "blockzoo_testing.distributed",
    "run_distributed": "blockzoo_testing.distributed",
    "LayerRun": "blockzoo_testing.runs",
    "LayerSignature": "blockzoo_testing.layers",
    "build_layer": "blockzoo_testing.runs",
    "check_decoding": "blockzoo_testing.decoding",
    "check_forward_slices": "blockzoo_testing.layers",
    "check_matches_layer": "blockzoo_testing.layers",
    "check_packed_documents": "blockzoo_testing.layers",
    "check_padded_batch": "blockzoo_testing.layers",
    "layer_inputs": "blockzoo_testing.runs",
    "layer_signature": "blockzoo_testing.layers",
    "relative_error": "blockzoo_testing.runs",
    "run_layer": "blockzoo_testing.runs",
    "single_process": "blockzoo_testing.runs",
    "check_recurrent_slices": "blockzoo_testing.recurrence",
    "check_config_error": "blockzoo_testing.configs",
    "check_imports_no_torch": "blockzoo_testing.configs",
    "check_registered": "blockzoo_testing.configs",
    "shortened_example": "blockzoo_testing.models",
    "greedy_by_full_forward": "blockzoo_testing.models",
    "check_trains_and_reloads": "blockzoo_testing.models",
    "check_every_parameter_gets_a_gradient": "blockzoo_testing.models",
    "check_bf16_compute": "blockzoo_testing.numerics",
    "check_generation_refusals": "blockzoo_testing.numerics",
    "check_matches_reference": "blockzoo_testing.numerics",
    "reference_activation": "blockzoo_testing.numerics",
    "parameter_shapes": "blockzoo_testing.numerics",
    "parameters_without_weight_decay": "blockzoo_testing.numerics",
    "CudaComparison": "blockzoo_testing.cuda",
    "RecurrentSliceTests": "blockzoo_testing.recurrence",
    "forward_over_slices": "blockzoo_testing.recurrence",
    "check_tensor_parallel": "blockzoo_testing.parallel",
    "check_sequence_data_parallel": "blockzoo_testing.parallel",
    "DETERMINISTIC": "blockzoo_testing.tracking",
    "Killed": "blockzoo_testing.tracking",
    "TINY_RUN": "blockzoo_testing.tracking",
    "logged_figures": "blockzoo_testing.tracking",
    "straight_and_resumed": "blockzoo_testing.tracking",
    "tiny_run_config": "blockzoo_testing.tracking",
    "train_killed_at": "blockzoo_testing.tracking",
    "train_tiny": "blockzoo_testing.tracking",
    "patch_bf16_dots": "blockzoo_testing.triton_interpreter",
    "patch_for_numpy": "blockzoo_testing.triton_interpreter",
    "run_interpreter_cases": "blockzoo_testing.triton_interpreter",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'blockzoo_testing' has no attribute {name!r}")
