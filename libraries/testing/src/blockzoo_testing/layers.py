"""Build a layer, make its inputs, run it and compare it: the conformance kit's pieces, public for plugins' own tests.

A plugin's tests check its layer against an oracle of their own (a float64 loop, transformers); what they share with
every other plugin is importable from here: `single_process(seed)` and `build_layer(config, hidden_size,
distributed)` make the layer, `layer_inputs(tokens)` the packed hidden states and loss weights, `run_layer` its output
and gradients (those live in `blockzoo_testing.runs`); `check_packed_documents` compares packed documents with each
document run alone, `check_padded_batch` a padded batch (empty documents first, a bound for `max_length`: CUDA graphs'
batches) with the exact one, `check_matches_layer` a layer with the same layer elsewhere (CUDA against the CPU path,
bf16 against fp32), `check_forward_slices` its run over slices of the documents, one after the other, against the
whole forward, `check_decoding` its generation against the full forward (`blockzoo_testing.decoding`);
`layer_signature` records what a config field may change, for tests that every field changes something.
The checks raise `ConformanceError` listing every problem.

A tolerance is a mapping: `{"atol": a, "rtol": r}` compares element by element as `torch.allclose` does;
`{"relative": r}` compares the whole tensor, ‖actual − expected‖ / ‖expected‖ < r (for bf16 and GPU kernels, whose
errors are relative and add up).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from blockzoo.layers.base import Batch, Layer, SequenceData
from blockzoo_testing.decoding import DECODING_LENGTHS, DECODING_STEPS, check_decoding
from blockzoo_testing.runs import (
    DEFAULT_HIDDEN_SIZE,
    DEFAULT_SEED,
    DEFAULT_TOLERANCE,
    ConformanceError,
    LayerRun,
    build_layer,
    layer_inputs,
    mismatch,
    relative_error,
    run_batch,
    run_layer,
    run_on,
    run_problems,
    run_slices,
    run_whole,
    single_process,
)

# What plugins' tests import from here, wherever it is defined.
__all__ = [
    "DECODING_LENGTHS",
    "DECODING_STEPS",
    "DEFAULT_HIDDEN_SIZE",
    "DEFAULT_SEED",
    "DEFAULT_TOLERANCE",
    "ConformanceError",
    "LayerRun",
    "LayerSignature",
    "build_layer",
    "check_decoding",
    "check_forward_slices",
    "check_matches_layer",
    "check_packed_documents",
    "check_padded_batch",
    "layer_inputs",
    "layer_signature",
    "relative_error",
    "run_layer",
    "single_process",
]


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
    expected = run_on(reference, hidden, weights, lengths)
    found = run_on(layer, hidden.to(dtype), weights, lengths)
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
        elif problem := mismatch(actual, wanted, tolerance, what):
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
    packed = run_on(layer, hidden, weights, lengths)
    alone = [
        run_on(layer, document, document_weights, [len(document)])
        for document, document_weights in zip(hidden.split(list(lengths)), weights.split(list(lengths)))
    ]
    starts = [sum(lengths[:index]) for index in range(len(lengths))]
    problems = [
        mismatch(
            getattr(packed, what)[start : start + length],
            getattr(run, what),
            tolerance,
            f"{label} of document {index} (tokens {start}:{start + length} of the packed batch {list(lengths)})",
        )
        for what, label in (("output", "the output"), ("input_grad", "the input gradient"))
        for index, (start, length, run) in enumerate(zip(starts, lengths, alone))
    ]
    problems += [
        mismatch(
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
    exact, exact_losses = run_batch(layer, hidden, weights, Batch(lengths, device=device))
    padded_batch = Batch(
        lengths,
        device=device,
        document_capacity=len(lengths) + extra_documents,
        length_bound=sum(lengths) if length_bound is None else length_bound,
    )
    padded, padded_losses = run_batch(layer, hidden, weights, padded_batch)
    label = f"a batch of {list(lengths)} padded"
    problems = run_problems(padded, exact, padded_losses, exact_losses, tolerance, label, "the exact batch")
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
    whole, whole_losses = run_whole(layer, hidden, weights, lengths)
    ranges = [(start, start + slice_length) for start in range(0, tokens, slice_length)]
    sliced, sliced_losses = run_slices(layer, hidden, weights, lengths, ranges, SequenceData())
    problems = run_problems(sliced, whole, sliced_losses, whole_losses, tolerance, f"slices of {slice_length} tokens")
    if problems:
        raise ConformanceError("\n".join([*problems, _SLICES_FIX]))


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
