"""The slice checks of a recurrent mixer whose carry is a causal convolution's last inputs and a scan's state (the
Mamba family's `blockzoo_ssm.SSMCarry`: `convolution` [kernel_size - 1, channels], `state`): one check that each
such mixer's tests call, with its own float64 reference and its own generation state.

The layout is fixed on purpose: 16 tokens in documents of 5, 1, 7 and 3; slices of 2 end on the document boundary
at 6, slices of 4 hold whole short documents and cut the long one, slices of 1 are shorter than a convolution's
kernel_size - 1. Under sequence-data parallelism: `check_sequence_data_parallel` (blockzoo_testing.parallel).
`RecurrentSliceTests` runs the check on a table of a mixer's cases as a base test class.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import pytest
import torch

from blockzoo.layers.base import Batch, Layer, slice_batch
from blockzoo_testing.layers import check_forward_slices
from blockzoo_testing.runs import ConformanceError, layer_inputs, mismatch

RECURRENT_LENGTHS = (5, 1, 7, 3)
RECURRENT_SLICE_LENGTHS = (1, 2, 4)
# The convolution's carry holds the very inputs generation stores (the same projection of the same tokens).
_INPUTS_TOLERANCE = {"atol": 1e-6, "rtol": 1e-6}


def check_recurrent_slices(
    layer: Layer,
    *,
    tolerance: Mapping[str, float] | None = None,
    reference_forward: Callable[[Layer, torch.Tensor, list[int]], torch.Tensor] | None = None,
    reference_tolerance: Mapping[str, float] | None = None,
    generation_carry: Callable[[Any], tuple[torch.Tensor, torch.Tensor]] | None = None,
    lengths: Sequence[int] = RECURRENT_LENGTHS,
    slice_lengths: Sequence[int] = RECURRENT_SLICE_LENGTHS,
) -> list[Any]:
    """A recurrent mixer's `forward_slice`, slice after slice over packed documents of `lengths` (each slice taking
    the carry of the one before), for each of `slice_lengths`; what is checked is what is given:

    - `tolerance`: the slices give the whole forward's output, input gradient and every parameter gradient
      (`check_forward_slices`);
    - `reference_forward(layer, hidden, lengths)` (float64, the layer's own parameters): the slices' outputs equal it
      within `reference_tolerance`;
    - `generation_carry(state)` -> (convolution [kernel_size - 1, channels], state) of sequence 0 of a generation
      state (`new_state`) in the carry's layout: the carry after the last slice (of the last slice length) equals
      what generation keeps after the last document, the one still open (the scan's state within `tolerance`, the
      convolution's rows of that document within 1e-6).

    Returns the carry after the last slice, for each slice length (in order), for checks of its type."""
    if reference_forward is not None and reference_tolerance is None:
        raise ValueError("check_recurrent_slices: a reference_forward needs its reference_tolerance")
    if tolerance is not None:
        for slice_length in slice_lengths:
            check_forward_slices(layer, lengths=lengths, slice_length=slice_length, tolerance=tolerance)
    hidden, _ = layer_inputs(sum(lengths), layer.hidden_dim.global_size)
    runs = [forward_over_slices(layer, hidden, list(lengths), slice_length) for slice_length in slice_lengths]
    problems = []
    if reference_forward is not None:
        expected = reference_forward(layer, hidden, list(lengths))
        for slice_length, (output, _) in zip(slice_lengths, runs, strict=True):
            what = f"the output of slices of {slice_length} tokens against the reference"
            problems.append(mismatch(output.double(), expected, reference_tolerance, what))
    if generation_carry is not None:
        problems += _carry_problems(layer, hidden, lengths[-1], runs[-1][1], generation_carry, tolerance)
    problems = [problem for problem in problems if problem]
    if problems:
        raise ConformanceError("\n".join(problems))
    return [carry for _, carry in runs]


def forward_over_slices(
    layer: Layer, hidden: torch.Tensor, lengths: Sequence[int], slice_length: int
) -> tuple[torch.Tensor, Any]:
    """The mixer's `forward_slice` without gradients over the packed documents of `lengths`, slice after slice of
    `slice_length` tokens (each taking the carry of the one before): the outputs concatenated and the last carry."""
    outputs, carry = [], None
    with torch.no_grad():
        for start in range(0, len(hidden), slice_length):
            stop = start + slice_length
            output, carry = layer.forward_slice(hidden[start:stop], slice_batch(lengths, start, stop), carry)
            outputs.append(output)
    return torch.cat(outputs), carry


def _carry_problems(layer, hidden, last_length, carry, generation_carry, tolerance) -> list[str | None]:
    state = layer.new_state(1, len(hidden), hidden.device, hidden.dtype)
    document = hidden[-last_length:]  # the last document: the one still open after the last slice
    with torch.no_grad():
        layer(document, Batch([len(document)], past_lengths=[0]), state)
    convolution, scan_state = generation_carry(state)
    rows = len(document)  # the carry's rows before the document are of the documents before it
    return [
        mismatch(carry.state, scan_state, tolerance or {"atol": 1e-5, "rtol": 1e-5}, "the carry's state"),
        mismatch(carry.convolution[-rows:], convolution[-rows:], _INPUTS_TOLERANCE, "the carry's convolution inputs"),
    ]


class RecurrentSliceTests:
    """Base test class: `check_recurrent_slices` on a table of cases of one recurrent mixer. Subclass it in a test
    module and set its class attributes (the functions as static methods); pytest runs three tests:

    - `test_slices_equal_the_whole_forward_and_every_gradient`, for each of `cases` (within `tolerance`);
    - `test_slices_match_the_reference`, for each of `reference_cases` (within `reference_tolerance`), also checking
      that every carry is a `carry_type`;
    - `test_the_carry_is_the_generation_state_after_the_sequence`, on `carry_case`, slices of 4 tokens.

    Example::

        class TestSlices(RecurrentSliceTests):
            cases = CASES  # name -> what `build` takes
            build = staticmethod(build_my_mixer)  # case -> layer
            tolerance = {"atol": 1e-5, "rtol": 1e-5}
            reference_forward = staticmethod(my_float64_loop)  # (layer, hidden, lengths) -> output
            reference_cases = ("small",)
            reference_tolerance = {"atol": 2e-6, "rtol": 1e-5}
            carry_case = "small"
            carry_type = MyCarry
            generation_carry = staticmethod(lambda state: (state.convolution[0].T, state.ssm[0]))

    `reference_forward` and `generation_carry` are those of `check_recurrent_slices`.
    """

    cases: ClassVar[Mapping[str, Any]]
    build: ClassVar[Callable[[Any], Layer]]
    tolerance: ClassVar[Mapping[str, float]]
    reference_forward: ClassVar[Callable[[Layer, torch.Tensor, list[int]], torch.Tensor]]
    reference_cases: ClassVar[Sequence[str]]
    reference_tolerance: ClassVar[Mapping[str, float]]
    carry_case: ClassVar[str]
    carry_type: ClassVar[type] = object
    generation_carry: ClassVar[Callable[[Any], tuple[torch.Tensor, torch.Tensor]]]

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "case" in metafunc.fixturenames:
            metafunc.parametrize("case", list(self.cases))
        if "reference_case" in metafunc.fixturenames:
            metafunc.parametrize("reference_case", list(self.reference_cases))

    def test_slices_equal_the_whole_forward_and_every_gradient(self, case: str) -> None:
        check_recurrent_slices(self.build(self.cases[case]), tolerance=self.tolerance)

    def test_slices_match_the_reference(self, reference_case: str) -> None:
        carries = check_recurrent_slices(
            self.build(self.cases[reference_case]),
            reference_forward=self.reference_forward,
            reference_tolerance=self.reference_tolerance,
        )
        assert all(isinstance(carry, self.carry_type) for carry in carries)

    def test_the_carry_is_the_generation_state_after_the_sequence(self) -> None:
        """The carry after the last slice holds what generation keeps after the same tokens: the convolution's last
        inputs and the scan's state of the open document."""
        layer = self.build(self.cases[self.carry_case])
        check_recurrent_slices(layer, tolerance=None, slice_lengths=(4,), generation_carry=self.generation_carry)
