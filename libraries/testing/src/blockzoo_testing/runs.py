"""Running a layer and comparing runs: the pieces every check of the kit shares.

`single_process(seed)` and `build_layer(config, hidden_size, distributed)` make a layer, `layer_inputs(tokens)` its
packed hidden states and loss weights, `run_layer` its output and gradients (`LayerRun`), `relative_error` compares two
tensors as a whole. The rest (`build`, `run_batch`, `run_slices`, `mismatch`, `run_problems`, ...) is what the kit's
own checks (`layers`, `decoding`, `recurrence`, `parallel`, `conformance`) share; a tolerance is read as
`blockzoo_testing.layers` says.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from blockzoo.config import Config
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.base import Batch, Layer, Mixer, SequenceData, slice_batch, slice_losses
from blockzoo.layers.dims import TensorDim
from blockzoo.model.block import check_layout
from blockzoo.plugins import get_registry

DEFAULT_SEED = 1234
DEFAULT_HIDDEN_SIZE = 16
DEFAULT_TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


class ConformanceError(AssertionError):
    """A plugin does not meet the layer contract; the message says what to change."""


def single_process(seed: int = DEFAULT_SEED, **options: Any) -> Distributed:
    """One process, the reference the parallel layouts match: gloo on the CPU unless `options` (fields of
    DistributedConfig) say otherwise, e.g. `backend="nccl"` for the GPU, `compute_dtype="bf16"`."""
    config = DistributedConfig(seed=seed, **{"backend": "gloo", **options})
    return Distributed(config, world_size=1, rank=0, local_rank=0)


def build_layer(
    config: Config, hidden_size: int = DEFAULT_HIDDEN_SIZE, distributed: Distributed | None = None
) -> Layer:
    """The layer of a mixer or MLP config, built by the implementation its type registers, named after its kind
    ("mixer", "mlp"), on `distributed` (default: `single_process()`)."""
    implementation = get_registry(strict=False).implementation_of(config)
    return build(implementation, config, hidden_size, distributed or single_process())


def layer_inputs(
    tokens: int, hidden_size: int = DEFAULT_HIDDEN_SIZE, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states [tokens, hidden_size] and the weights of the loss sum(output · weights), standard normal."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, hidden_size, generator=generator), torch.randn(tokens, hidden_size, generator=generator)


class LayerRun(NamedTuple):
    output: torch.Tensor
    input_grad: torch.Tensor
    grads: dict[str, torch.Tensor]  # Of each trainable parameter, by name; zeros where none reached it.


def run_layer(layer: Layer, hidden: torch.Tensor, batch: Batch, loss_weights: torch.Tensor) -> LayerRun:
    """The output, the input gradient and the parameter gradients of the loss sum(output · loss_weights)."""
    layer.zero_grad(set_to_none=True)
    hidden = hidden.detach().clone().requires_grad_()
    output = layer(hidden, batch)
    (output * loss_weights).sum().backward()
    return layer_run(layer, output, hidden)


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """‖value − reference‖ / ‖reference‖, in fp32 on the CPU (the two may be on different devices)."""
    reference = reference.detach().float().cpu()
    return float((value.detach().float().cpu() - reference).norm() / reference.norm())


def mismatch(actual: torch.Tensor, expected: torch.Tensor, tolerance: Mapping[str, float], what: str) -> str | None:
    """None when `actual` equals `expected` within `tolerance` (see the module), else what differs and by how much."""
    if actual.shape != expected.shape:
        return f"{what} has shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    if "relative" in tolerance:
        error = relative_error(actual, expected)
        if error < tolerance["relative"]:
            return None
        return f"{what} differs (relative error {error:.3g}, beyond {tolerance['relative']:g})"
    actual, expected = actual.detach().cpu().double(), expected.detach().cpu().double()
    if torch.allclose(actual, expected, **tolerance):
        return None
    difference = (actual - expected).abs().nan_to_num(float("inf"))
    return (
        f"{what} differs (max abs difference {difference.max().item():.3g} at "
        f"{[int(i) for i in torch.unravel_index(difference.argmax(), difference.shape)]}, beyond "
        f"{', '.join(f'{key}={value:g}' for key, value in tolerance.items())})"
    )


def build(implementation: Any, config: Config, hidden_size: int, distributed: Distributed) -> Layer:
    """The layer of `config` built by `implementation`, a class the caller loaded (a gloo rank's registry does not hold
    a plugin its parent registered in-process). The engine's layout check runs first, as when a model is built."""
    check_layout(config, config.kind, distributed)
    return implementation(
        config, name=config.kind, hidden_dim=TensorDim("hidden", hidden_size), distributed=distributed, lr_scale=1.0
    )


def run_whole(
    layer: Layer, hidden: torch.Tensor, weights: torch.Tensor, lengths: Sequence[int]
) -> tuple[LayerRun, dict[str, torch.Tensor]]:
    """The run of `layer` over the whole batch, its objective holding the named losses too; and those losses."""
    return run_batch(layer, hidden, weights, Batch(lengths, device=layer.distributed.device))


def run_batch(
    layer: Layer, hidden: torch.Tensor, weights: torch.Tensor, batch: Batch
) -> tuple[LayerRun, dict[str, torch.Tensor]]:
    device = layer.distributed.device
    layer.zero_grad(set_to_none=True)
    hidden = hidden.detach().clone().to(device).requires_grad_()
    output = layer(hidden, batch)
    objective = (output * weights.to(device)).sum() + sum(batch.losses.values(), torch.zeros((), device=device))
    objective.backward()
    return layer_run(layer, output, hidden), {name: value.detach() for name, value in batch.losses.items()}


def run_slices(
    layer: Layer,
    hidden: torch.Tensor,
    weights: torch.Tensor,
    lengths: Sequence[int],
    ranges: Sequence[tuple[int, int]],
    sequence_data: SequenceData,
) -> tuple[LayerRun, dict[str, torch.Tensor]]:
    """The run of `layer` over the slices [start, stop) of `ranges` of the batch, one after the other (this rank's
    slices of `sequence_data`'s group), its objective holding this rank's outputs and the micro-batch's named losses
    (as the trainer's does: each rank's once). The output and input gradient are those of the slices' tokens."""
    device = layer.distributed.device
    layer.zero_grad(set_to_none=True)
    hidden = hidden.detach().clone().to(device).requires_grad_()
    weights = weights.to(device)
    batches = [slice_batch(lengths, start, stop, sequence_data=sequence_data, device=device) for start, stop in ranges]
    carry, outputs = None, []
    for (start, stop), batch in zip(ranges, batches):
        if isinstance(layer, Mixer):
            output, carry = layer.forward_slice(hidden[start:stop], batch, carry)
        else:
            output = layer(hidden[start:stop], batch)
        outputs.append(output)
    losses = slice_losses(batches)
    objective = sum((output * weights[start:stop]).sum() for output, (start, stop) in zip(outputs, ranges))
    objective = objective + sum(losses.values(), torch.zeros((), device=device))
    objective.backward()
    run = layer_run(layer, torch.cat(outputs), hidden)
    own_grad = torch.cat([run.input_grad[start:stop] for start, stop in ranges])
    return run._replace(input_grad=own_grad), {name: value.detach() for name, value in losses.items()}


def layer_run(layer: Layer, output: torch.Tensor, hidden: torch.Tensor) -> LayerRun:
    grads = {
        name: torch.zeros_like(parameter) if parameter.grad is None else parameter.grad.clone()
        for name, parameter in layer.named_parameters()
        if parameter.requires_grad
    }
    input_grad = torch.zeros_like(hidden) if hidden.grad is None else hidden.grad
    return LayerRun(output.detach(), input_grad, grads)


def run_problems(
    found: LayerRun,
    expected: LayerRun,
    found_losses: dict[str, torch.Tensor],
    expected_losses: dict[str, torch.Tensor],
    tolerance: Mapping[str, float],
    label: str,
    reference: str = "the whole forward",
    rows: slice | torch.Tensor = slice(None),
    parameter_gradient_tolerance: Mapping[str, float] | None = None,
) -> list[str]:
    """What differs between two runs (`rows`: the tokens of `expected` that `found` holds). The parameter gradients
    are compared within `parameter_gradient_tolerance` (default `tolerance`)."""
    gradient_tolerance = tolerance if parameter_gradient_tolerance is None else parameter_gradient_tolerance
    problems = [
        mismatch(found.output, expected.output[rows], tolerance, f"{label}: the output"),
        mismatch(found.input_grad, expected.input_grad[rows], tolerance, f"{label}: the input gradient"),
    ]
    problems += [
        mismatch(gradient, expected.grads[name], gradient_tolerance, f"{label}: the gradient of {name!r}")
        for name, gradient in found.grads.items()
    ]
    if found_losses.keys() != expected_losses.keys():
        problems.append(f"{label}: the named losses are {sorted(found_losses)}, expected {sorted(expected_losses)}")
    else:
        problems += [
            mismatch(value, expected_losses[name], tolerance, f"{label}: the named loss {name!r}")
            for name, value in found_losses.items()
        ]
    return [f"{problem} from {reference}" for problem in problems if problem is not None]


def run_on(layer: Layer, hidden: torch.Tensor, weights: torch.Tensor, lengths: Sequence[int]) -> LayerRun:
    device = layer.distributed.device
    return run_layer(layer, hidden.to(device), Batch(lengths, device=device), weights.to(device))
