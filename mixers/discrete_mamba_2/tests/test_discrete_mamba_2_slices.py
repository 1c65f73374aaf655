"""The discrete Mamba 2 mixer over slices of longer sequences (`forward_slice`, micro-sequences on one process), by
the kit's `check_recurrent_slices`: the slices run one after the other, each taking the carry of the one before,
give the whole forward's output and every gradient (input and parameters), the float64 per-token loop's output, and
a carry equal to what generation keeps. Documents straddle slice boundaries, are shorter than a slice, have one
token, and end on a slice boundary; slices of one token are shorter than the convolution's window. Under
sequence-data parallelism: tests/test_mamba_sequence_data_parallel.py."""

import pytest
from dm2_reference import build, reference_forward
from test_discrete_mamba_2 import CASES

from blockzoo_ssm import SSMCarry
from blockzoo_testing import check_recurrent_slices

TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


@pytest.mark.parametrize("case", CASES)
def test_slices_equal_the_whole_forward_and_every_gradient(case):
    check_recurrent_slices(build(CASES[case]), tolerance=TOLERANCE)


@pytest.mark.parametrize("case", ["one-group-silu-kernel-2", "z-bias-no-conv-bias-mha"])
def test_slices_match_the_per_token_loop(case):
    reference_tolerance = {"atol": 1e-5, "rtol": 1e-5}
    layer = build(CASES[case])
    carries = check_recurrent_slices(
        layer, reference_forward=reference_forward, reference_tolerance=reference_tolerance
    )
    assert all(isinstance(carry, SSMCarry) for carry in carries)


def test_the_carry_is_the_generation_state_after_the_sequence():
    """The carry after the last slice holds what generation keeps after the same tokens: the convolution's last
    inputs and the SSM state of the open document."""
    layer = build(CASES["grouped-identity"])
    check_recurrent_slices(
        layer, tolerance=None, slice_lengths=(4,), generation_carry=lambda state: (state.conv[0].T, state.ssm[0])
    )
