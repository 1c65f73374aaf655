"""Build a layer, make its inputs, run it and compare it: the conformance kit's pieces, public for plugins' own tests.

A plugin's tests check its layer against an oracle of their own (a float64 loop, transformers); what they share with
every other plugin is here: `single_process(seed)` and `build_layer(config, hidden_size, distributed)` make the
layer, `layer_inputs(tokens)` the packed hidden states and loss weights, `run_layer` its output and gradients;
`check_packed_documents` compares packed documents with each document run alone, `check_padded_batch` a padded
batch (empty documents first, a bound for `max_length`: CUDA graphs' batches) with the exact one,
`check_matches_layer` a layer with the same layer elsewhere (CUDA against the CPU path, bf16 against fp32),
`check_decoding` its generation against the full forward, `check_forward_slices` its run over slices of the
documents, one after the other, against the whole forward; `layer_signature` records what a config field may
change, for tests that every field changes something.
The checks raise `ConformanceError` listing every problem.

A tolerance is a mapping: `{"atol": a, "rtol": r}` compares element by element as `torch.allclose` does;
`{"relative": r}` compares the whole tensor, ‖actual − expected‖ / ‖expected‖ < r (for bf16 and GPU kernels, whose
errors are relative and add up).
"""

from __future__ import annotations

import dataclasses
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
# Two sequences decoded from a prefill of different lengths, then a chunk of several tokens, then one at a time.
DECODING_LENGTHS = (6, 4)
DECODING_STEPS = ((3, 2), (2, 1), (1, 1))
_DECODING_FIX = (
    "new_state(...) must hold all that forward needs from earlier tokens (KV cache, convolution window, recurrent "
    "state), and forward(hidden, batch, state) with batch.past_lengths set must read it and append the batch's tokens "
    "(document i of the batch is sequence i of the state)."
)


_SLICES_FIX = (
    "Over slices of sequences, forward_slice(hidden, batch, previous) must give what the whole forward gives for the "
    "slice's tokens: batch holds the slice's pieces of documents, batch.positions count from each document's start "
    "(batch.continued tokens of the first piece's document come before the slice); previous is what the slice before "
    "returned as its carry (None for the first), and the carry returned must hold all that later slices need of this "
    "one and the ones before it (keys and values of the open document, the recurrent state and the convolution's last "
    "inputs), differentiably: the gradients of later slices flow back through it. A named loss that is a function of "
    "sums over the tokens goes through batch.add_statistics_loss, so that it covers every slice."
)
_PADDING_FIX = (
    "A padded batch (what training.cuda_graphs runs: Batch.bucketed) starts with empty documents (zero lengths: "
    "cu_seqlens starts with repeated zeros, no token is theirs), and its max_length is a bound on the documents' "
    "lengths, not the longest: size work by batch.num_tokens, let empty documents contribute nothing, use max_length "
    "only as an upper bound."
)
_PACKING_FIX = (
    "Information crosses a document boundary: every token may see only tokens of its own document. Restart "
    "convolutions, recurrences and attention at each document (batch.cu_seqlens, batch.document_index, "
    "batch.positions); keep no state between calls."
)


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
    return _build(implementation, config, hidden_size, distributed or single_process())


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
    return _layer_run(layer, output, hidden)


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """‖value − reference‖ / ‖reference‖, in fp32 on the CPU (the two may be on different devices)."""
    reference = reference.detach().float().cpu()
    return float((value.detach().float().cpu() - reference).norm() / reference.norm())


def check_matches_layer(
    layer: Layer,
    reference: Layer,
    *,
    lengths: Sequence[int],
    output_tolerance: Mapping[str, float],
    gradient_tolerance: Mapping[str, float] | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> None:
    """`layer` (on its device, fed `dtype` hidden states) gives the outputs, input gradient and parameter gradients of
    `reference` (on its device, in fp32) for the same documents `lengths`: e.g. the layer on CUDA against the same
    config on the CPU path. The output must be `dtype` and everything finite. `gradient_tolerance` defaults to
    `output_tolerance`."""
    gradient_tolerance = output_tolerance if gradient_tolerance is None else gradient_tolerance
    hidden, weights = layer_inputs(sum(lengths), reference.hidden_dim.global_size, seed)
    expected = _run_on(reference, hidden, weights, lengths)
    found = _run_on(layer, hidden.to(dtype), weights, lengths)
    problems = []
    if found.output.dtype != dtype:
        problems.append(f"the output is {found.output.dtype}, expected {dtype} (the dtype of the input)")
    compared = [("the output", found.output, expected.output, output_tolerance)]
    compared.append(("the input gradient", found.input_grad, expected.input_grad, gradient_tolerance))
    if found.grads.keys() != expected.grads.keys():
        problems.append(f"the trainable parameters are {sorted(found.grads)}, expected {sorted(expected.grads)}")
    compared += [
        (f"the gradient of {name!r}", found.grads[name], expected.grads[name], gradient_tolerance)
        for name in found.grads.keys() & expected.grads.keys()
    ]
    for what, actual, wanted, tolerance in compared:
        if not bool(torch.isfinite(actual).all()):
            problems.append(f"{what} is not finite")
        elif problem := _mismatch(actual, wanted, tolerance, what):
            problems.append(problem)
    if problems:
        raise ConformanceError("\n".join(problems))


def check_packed_documents(
    layer: Layer,
    *,
    lengths: Sequence[int],
    tolerance: Mapping[str, float],
    parameter_gradient_tolerance: Mapping[str, float] | None = None,
    seed: int = 0,
) -> None:
    """Documents of `lengths` packed in one batch give each document's output and input gradient as the document run
    alone, and each parameter gradient as the sum of the documents' own. `parameter_gradient_tolerance` (default:
    `tolerance`) is for the parameter gradients, sums over the tokens of all documents taken in another order."""
    parameter_gradient_tolerance = tolerance if parameter_gradient_tolerance is None else parameter_gradient_tolerance
    hidden, weights = layer_inputs(sum(lengths), layer.hidden_dim.global_size, seed)
    packed = _run_on(layer, hidden, weights, lengths)
    alone = [
        _run_on(layer, document, document_weights, [len(document)])
        for document, document_weights in zip(hidden.split(list(lengths)), weights.split(list(lengths)))
    ]
    starts = [sum(lengths[:index]) for index in range(len(lengths))]
    problems = [
        _mismatch(
            getattr(packed, what)[start : start + length],
            getattr(run, what),
            tolerance,
            f"{label} of document {index} (tokens {start}:{start + length} of the packed batch {list(lengths)})",
        )
        for what, label in (("output", "the output"), ("input_grad", "the input gradient"))
        for index, (start, length, run) in enumerate(zip(starts, lengths, alone))
    ]
    problems += [
        _mismatch(
            gradient,
            sum(run.grads[name] for run in alone),
            parameter_gradient_tolerance,
            f"the gradient of {name!r}, packed vs summed over the documents alone",
        )
        for name, gradient in packed.grads.items()
    ]
    problems = [problem for problem in problems if problem is not None]
    if problems:
        raise ConformanceError("\n".join([*problems, _PACKING_FIX]))


def check_padded_batch(
    layer: Layer,
    *,
    lengths: Sequence[int],
    tolerance: Mapping[str, float],
    extra_documents: int = 3,
    length_bound: int | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> None:
    """A padded batch of documents `lengths` (`extra_documents` empty ones before them, `max_length` raised to
    `length_bound`, default the token count) gives the outputs and gradients of the exact batch, both fed `dtype`
    hidden states: what `training.cuda_graphs` runs (`Batch.bucketed`)."""
    device = layer.distributed.device
    hidden, weights = layer_inputs(sum(lengths), layer.hidden_dim.global_size, seed)
    hidden = hidden.to(dtype)
    exact, exact_losses = _run_batch(layer, hidden, weights, Batch(lengths, device=device))
    padded_batch = Batch(
        lengths,
        device=device,
        document_capacity=len(lengths) + extra_documents,
        length_bound=sum(lengths) if length_bound is None else length_bound,
    )
    padded, padded_losses = _run_batch(layer, hidden, weights, padded_batch)
    label = f"a batch of {list(lengths)} padded"
    problems = _run_problems(padded, exact, padded_losses, exact_losses, tolerance, label, "the exact batch")
    if problems:
        raise ConformanceError("\n".join([*problems, _PADDING_FIX]))


def check_forward_slices(
    layer: Layer,
    *,
    lengths: Sequence[int],
    slice_length: int,
    tolerance: Mapping[str, float],
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> None:
    """Packed documents of `lengths` cut into consecutive slices of `slice_length` tokens, run one after the other
    (a mixer's `forward_slice`, each taking the previous one's carry; an MLP's forward on each slice's batch), give
    the whole forward's output, input gradient and parameter gradients, and its named losses (all differentiated
    through the objective sum(output · weights) + the named losses), the layer on its device fed `dtype` hidden
    states both ways."""
    tokens = sum(lengths)
    if tokens % slice_length:
        raise ValueError(f"slices of {slice_length} tokens do not divide the {tokens} tokens of documents {lengths}")
    hidden, weights = layer_inputs(tokens, layer.hidden_dim.global_size, seed)
    hidden = hidden.to(dtype)
    whole, whole_losses = _run_whole(layer, hidden, weights, lengths)
    ranges = [(start, start + slice_length) for start in range(0, tokens, slice_length)]
    sliced, sliced_losses = _run_slices(layer, hidden, weights, lengths, ranges, SequenceData())
    problems = _run_problems(sliced, whole, sliced_losses, whole_losses, tolerance, f"slices of {slice_length} tokens")
    if problems:
        raise ConformanceError("\n".join([*problems, _SLICES_FIX]))


def check_decoding(
    layer: Layer,
    *,
    tolerance: Mapping[str, float],
    lengths: Sequence[int] = DECODING_LENGTHS,
    steps: Sequence[Sequence[int]] = DECODING_STEPS,
    reference: Layer | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> None:
    """Generating with `layer` equals the full forward of `reference` (default: `layer` itself): sequences of `lengths`
    tokens, fed in `steps` (step i gives sequence j `steps[i][j]` tokens; the first step is the prefill) to a state
    from `new_state`, in `dtype`."""
    reference = layer if reference is None else reference
    problems = _decoding_problems(layer, reference, tolerance, lengths, steps, dtype, seed)
    if problems:
        raise ConformanceError("\n".join([*problems, _DECODING_FIX]))


@dataclasses.dataclass(frozen=True)
class LayerSignature:
    """All that a config field may change in a layer: its parameters (value, ParameterMeta, trainable, by name), and
    its output and added losses on the inputs of `layer_inputs`."""

    parameters: dict[str, tuple[torch.Tensor, Any, bool]]
    output: torch.Tensor
    losses: dict[str, torch.Tensor]

    def differs_from(self, other: LayerSignature, tolerance: Mapping[str, float] = DEFAULT_TOLERANCE) -> bool:
        """Whether the parameters differ (names, shapes, values, settings, trainable) or the output or a loss differs
        beyond `tolerance` (element by element, as `torch.allclose`)."""
        if self.parameters.keys() != other.parameters.keys() or self.losses.keys() != other.losses.keys():
            return True
        for (value, meta, trained), (other_value, other_meta, other_trained) in zip(
            self.parameters.values(), other.parameters.values()
        ):
            if value.shape != other_value.shape or not torch.equal(value, other_value) or trained != other_trained:
                return True
            if getattr(meta, "settings", None) != getattr(other_meta, "settings", None):
                return True
        if self.output.shape != other.output.shape:
            return True
        if not torch.allclose(self.output.double(), other.output.double(), **tolerance):
            return True
        return any(not torch.allclose(self.losses[name], other.losses[name], **tolerance) for name in self.losses)


def layer_signature(layer: Layer, lengths: Sequence[int], *, random_seed: int = DEFAULT_SEED) -> LayerSignature:
    """The parameters of `layer` and its output and added losses on `layer_inputs` packed as documents of `lengths`
    (torch's global generator seeded with `random_seed` first, for layers that draw randomness in forward)."""
    hidden, _ = layer_inputs(sum(lengths), layer.hidden_dim.global_size)
    batch = Batch(lengths, device=layer.distributed.device)
    torch.manual_seed(random_seed)
    with torch.no_grad():
        output = layer(hidden.to(layer.distributed.device), batch)
    parameters = {
        name: (parameter.detach().clone(), getattr(parameter, "meta", None), parameter.requires_grad)
        for name, parameter in layer.named_parameters()
    }
    losses = {name: value.detach() for name, value in batch.losses.items()}
    return LayerSignature(parameters, output, losses)


# ---------------------------------------------------------------------------------------------------------------------
# Shared with the rest of the kit


def _decoding_problems(
    layer: Layer,
    reference: Layer,
    tolerance: Mapping[str, float],
    lengths: Sequence[int],
    steps: Sequence[Sequence[int]],
    dtype: torch.dtype,
    seed: int,
) -> list[str]:
    """What `check_decoding` finds: for each sequence that differs, the first step that does (else the whole)."""
    if [sum(step[index] for step in steps) for index in range(len(lengths))] != list(lengths):
        raise ValueError(f"the decoding steps {steps} do not add up to the sequences' lengths {list(lengths)}")
    hidden = layer_inputs(sum(lengths), layer.hidden_dim.global_size, seed)[0].to(dtype)
    reference_device, device = reference.distributed.device, layer.distributed.device
    with torch.no_grad():
        expected = reference(hidden.to(reference_device), Batch(lengths, device=reference_device)).split(lengths)
    state = layer.new_state(len(lengths), max(lengths), device, dtype) if isinstance(layer, Mixer) else None
    sequences, past = hidden.to(device).split(lengths), [0] * len(lengths)
    decoded: list[list[tuple[int, int, torch.Tensor]]] = [[] for _ in lengths]  # Per sequence: (step, start, output).
    for number, step in enumerate(steps):
        chunk = torch.cat([sequence[start : start + count] for sequence, start, count in zip(sequences, past, step)])
        with torch.no_grad():
            output = layer(chunk, Batch(step, past_lengths=past, device=device), state)
        for index, part in enumerate(output.split(list(step))):
            decoded[index].append((number, past[index], part))
        past = [start + count for start, count in zip(past, step)]
    problems = []
    for index, (parts, wanted) in enumerate(zip(decoded, expected)):
        whole = _mismatch(torch.cat([part for *_, part in parts]), wanted, tolerance, f"decoded sequence {index}")
        if whole is None:
            continue
        in_steps = (
            _mismatch(
                part,
                wanted[start : start + len(part)],
                tolerance,
                f"decoding step {number} ({len(part)} tokens after {start}) of sequence {index}",
            )
            for number, start, part in parts
        )
        problems.append(f"{next(filter(None, in_steps), whole)} from the full forward")
    return problems


def _mismatch(actual: torch.Tensor, expected: torch.Tensor, tolerance: Mapping[str, float], what: str) -> str | None:
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


def _build(implementation: Any, config: Config, hidden_size: int, distributed: Distributed) -> Layer:
    """The layer of `config` built by `implementation`, a class the caller loaded (a gloo rank's registry does not hold
    a plugin its parent registered in-process). The engine's layout check runs first, as when a model is built."""
    check_layout(config, config.kind, distributed)
    return implementation(
        config, name=config.kind, hidden_dim=TensorDim("hidden", hidden_size), distributed=distributed, lr_scale=1.0
    )


def _run_whole(
    layer: Layer, hidden: torch.Tensor, weights: torch.Tensor, lengths: Sequence[int]
) -> tuple[LayerRun, dict[str, torch.Tensor]]:
    """The run of `layer` over the whole batch, its objective holding the named losses too; and those losses."""
    return _run_batch(layer, hidden, weights, Batch(lengths, device=layer.distributed.device))


def _run_batch(
    layer: Layer, hidden: torch.Tensor, weights: torch.Tensor, batch: Batch
) -> tuple[LayerRun, dict[str, torch.Tensor]]:
    device = layer.distributed.device
    layer.zero_grad(set_to_none=True)
    hidden = hidden.detach().clone().to(device).requires_grad_()
    output = layer(hidden, batch)
    objective = (output * weights.to(device)).sum() + sum(batch.losses.values(), torch.zeros((), device=device))
    objective.backward()
    return _layer_run(layer, output, hidden), {name: value.detach() for name, value in batch.losses.items()}


def _run_slices(
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
    run = _layer_run(layer, torch.cat(outputs), hidden)
    own_grad = torch.cat([run.input_grad[start:stop] for start, stop in ranges])
    return run._replace(input_grad=own_grad), {name: value.detach() for name, value in losses.items()}


def _layer_run(layer: Layer, output: torch.Tensor, hidden: torch.Tensor) -> LayerRun:
    grads = {
        name: torch.zeros_like(parameter) if parameter.grad is None else parameter.grad.clone()
        for name, parameter in layer.named_parameters()
        if parameter.requires_grad
    }
    input_grad = torch.zeros_like(hidden) if hidden.grad is None else hidden.grad
    return LayerRun(output.detach(), input_grad, grads)


def _run_problems(
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
        _mismatch(found.output, expected.output[rows], tolerance, f"{label}: the output"),
        _mismatch(found.input_grad, expected.input_grad[rows], tolerance, f"{label}: the input gradient"),
    ]
    problems += [
        _mismatch(gradient, expected.grads[name], gradient_tolerance, f"{label}: the gradient of {name!r}")
        for name, gradient in found.grads.items()
    ]
    if found_losses.keys() != expected_losses.keys():
        problems.append(f"{label}: the named losses are {sorted(found_losses)}, expected {sorted(expected_losses)}")
    else:
        problems += [
            _mismatch(value, expected_losses[name], tolerance, f"{label}: the named loss {name!r}")
            for name, value in found_losses.items()
        ]
    return [f"{problem} from {reference}" for problem in problems if problem is not None]


def _run_on(layer: Layer, hidden: torch.Tensor, weights: torch.Tensor, lengths: Sequence[int]) -> LayerRun:
    device = layer.distributed.device
    return run_layer(layer, hidden.to(device), Batch(lengths, device=device), weights.to(device))
