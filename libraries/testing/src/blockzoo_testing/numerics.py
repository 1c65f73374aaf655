"""Checks a mixer's own tests share beyond the conformance kit: its output against a float64 reference of its own,
its activations in bf16 against fp32, and the refusals of a generation state that does not fit the batch; and the
MLP activations written out in plain torch (`reference_activation`), for an MLP plugin's per-token reference.

Each builds its inputs with `layer_inputs` at the layer's hidden size and fails with an AssertionError.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from blockzoo.layers.base import Batch, Layer
from blockzoo_testing.runs import ConformanceError, layer_inputs, relative_error, run_layer

Reference = Callable[[Layer, torch.Tensor, list[int]], torch.Tensor]


def check_matches_reference(
    layer: Layer, reference_forward: Reference, *, lengths: Sequence[int], atol: float, rtol: float
) -> torch.Tensor:
    """The layer's output over packed documents of `lengths` equals `reference_forward(layer, hidden, lengths)` (in
    float64, with the layer's own parameters: a per-token loop, say) within atol and rtol
    (`torch.testing.assert_close`). Returns the layer's output, for further checks of its own."""
    lengths = list(lengths)
    hidden, _ = layer_inputs(sum(lengths), layer.hidden_dim.global_size)
    with torch.no_grad():
        output = layer(hidden, Batch(lengths))
    torch.testing.assert_close(output.double(), reference_forward(layer, hidden, lengths), atol=atol, rtol=rtol)
    return output


def check_bf16_compute(layer: Layer, fp32_layer: Layer, *, lengths: Sequence[int], relative: float = 3e-2) -> None:
    """`layer` computes in bf16 (built with `compute_dtype="bf16"`, master weights fp32) and `fp32_layer` is the same
    layer in fp32: fed bf16 hidden states the output and the input gradient are bf16, every parameter gradient is
    fp32 and finite, and the output is within `relative` (‖x − fp32‖ / ‖fp32‖) of the fp32 layer's."""
    lengths = list(lengths)
    hidden, loss_weights = layer_inputs(sum(lengths), layer.hidden_dim.global_size)
    with torch.no_grad():
        expected = fp32_layer(hidden, Batch(lengths))
    output, input_grad, grads = run_layer(layer, hidden.bfloat16(), Batch(lengths), loss_weights)
    if not output.dtype == input_grad.dtype == torch.bfloat16:
        raise ConformanceError(
            f"bf16 compute gave an output of {output.dtype} and an input gradient of {input_grad.dtype}"
        )
    for name, gradient in grads.items():
        if gradient.dtype != torch.float32 or not bool(torch.isfinite(gradient).all()):
            raise ConformanceError(f"bf16 compute: the gradient of {name} is {gradient.dtype} or not finite")
    error = relative_error(output, expected)
    if not error < relative:
        raise ConformanceError(f"bf16 compute: the output's relative error to fp32 is {error:.2e} (at most {relative})")


def check_generation_refusals(
    layer: Layer, *, holder: str = "state", missing_past: str = r"needs `batch\.past_lengths`"
) -> Any:
    """A generation state of 2 sequences (`new_state`) is refused with a ValueError for a batch without
    `past_lengths` (the message matching `missing_past`) and for a batch of 1 sequence ("the batch has 1 sequences
    but the {holder} holds 2"). Returns the state."""
    state = layer.new_state(2, 4, torch.device("cpu"), torch.float32)
    hidden, _ = layer_inputs(3, layer.hidden_dim.global_size)
    with pytest.raises(ValueError, match=missing_past):
        layer(hidden, Batch([2, 1]), state)
    with pytest.raises(ValueError, match=f"the batch has 1 sequences but the {holder} holds 2"):
        layer(hidden, Batch([3], past_lengths=[0]), state)
    return state


def reference_activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """The MLP activation `name` (silu, gelu with erf, relu, squared_relu, identity) written out in plain torch,
    independent of blockzoo's own, for the per-token reference of an MLP plugin's tests."""
    if name == "silu":
        return x / (1 + torch.exp(-x))
    if name == "gelu":
        return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    if name == "relu":
        return torch.where(x > 0, x, 0.0)
    if name == "squared_relu":
        return torch.where(x > 0, x * x, 0.0)
    if name != "identity":
        raise ValueError(f"reference_activation: no reference for activation {name!r}")
    return x


def parameter_shapes(layer: Layer) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape by its name in the layer, after checking that the parameter factory named it by its
    module path under the layer's name (checkpoints key tensors by that name)."""
    for name, parameter in layer.named_parameters():
        if parameter.meta.name != f"{layer.name}.{name}":
            raise ConformanceError(f"parameter {name!r} is named {parameter.meta.name!r}, not {layer.name}.{name}")
    return {name: tuple(parameter.shape) for name, parameter in layer.named_parameters()}


def parameters_without_weight_decay(layer: Layer) -> set[str]:
    """The names in the layer of the parameters whose (first) optimizer settings have no weight decay."""
    return {name for name, parameter in layer.named_parameters() if not parameter.meta.settings[0].weight_decay}
