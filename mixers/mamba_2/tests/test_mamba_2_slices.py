"""The Mamba 2 mixer over slices of longer sequences (`forward_slice`, micro-sequences on one process): the slices run
one after the other, each taking the carry of the one before, give the whole forward's output and every gradient
(input and parameters), and the float64 per-token loop's output. Documents straddle slice boundaries, are shorter
than a slice, have one token, and end on a slice boundary; slices of one token are shorter than the convolution's
window. Under sequence-data parallelism: tests/test_mamba_sequence_data_parallel.py."""

import pytest
import torch
from mamba_2_reference import build, reference_forward
from test_mamba_2 import CASES

from blockzoo.layers.base import Batch, slice_batch
from blockzoo.ssm import SSMCarry
from blockzoo.testing import check_forward_slices, layer_inputs

# 16 tokens: slices of 2 end on the document boundary at 6, slices of 4 hold whole short documents and cut the long
# one, slices of 1 are shorter than the convolution's kernel_size - 1.
LENGTHS = [5, 1, 7, 3]
SLICE_LENGTHS = (1, 2, 4)
TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


def _outputs_over_slices(layer, hidden, slice_length):
    outputs, carry = [], None
    with torch.no_grad():
        for start in range(0, len(hidden), slice_length):
            stop = start + slice_length
            output, carry = layer.forward_slice(hidden[start:stop], slice_batch(LENGTHS, start, stop), carry)
            outputs.append(output)
    return torch.cat(outputs), carry


@pytest.mark.parametrize("case", CASES)
def test_slices_equal_the_whole_forward_and_every_gradient(case):
    layer = build(CASES[case])
    for slice_length in SLICE_LENGTHS:
        check_forward_slices(layer, lengths=LENGTHS, slice_length=slice_length, tolerance=TOLERANCE)


@pytest.mark.parametrize("case", ["groups-per-group-norm", "biases-dt-limit-no-conv-bias"])
def test_slices_match_the_per_token_loop(case):
    layer = build(CASES[case])
    hidden, _ = layer_inputs(sum(LENGTHS))
    expected = reference_forward(layer, hidden, LENGTHS)
    for slice_length in SLICE_LENGTHS:
        output, carry = _outputs_over_slices(layer, hidden, slice_length)
        torch.testing.assert_close(output.double(), expected, atol=2e-5, rtol=1e-4)
        assert isinstance(carry, SSMCarry)


def test_the_carry_is_the_generation_state_after_the_sequence():
    """The carry after the last slice holds what generation keeps after the same tokens: the convolution's last
    inputs and the SSM state of the open document."""
    layer = build(CASES["groups-per-group-norm"])
    hidden, _ = layer_inputs(sum(LENGTHS))
    _, carry = _outputs_over_slices(layer, hidden, 4)
    state = layer.new_state(1, 16, torch.device("cpu"), torch.float32)
    document = hidden[-LENGTHS[-1] :]  # the last document: the one still open after the last slice
    with torch.no_grad():
        layer(document, Batch([len(document)], past_lengths=[0]), state)
    torch.testing.assert_close(carry.state, state.ssm[0], atol=1e-5, rtol=1e-5)
    stored = state.convolution[0].T  # [kernel_size - 1, channels]; the carry's rows of the last document
    torch.testing.assert_close(carry.convolution[-len(document) :], stored[-len(document) :], atol=1e-6, rtol=1e-6)
