"""The Mamba mixer over slices of longer sequences (`forward_slice`, micro-sequences on one process), by the kit's
`check_recurrent_slices`: the slices run one after the other, each taking the carry of the one before, give the
whole forward's output and every gradient (input and parameters), the float64 per-token loop's output, and a carry
equal to what generation keeps. Documents straddle slice boundaries, are shorter than a slice, have one token, and
end on a slice boundary; slices of one token are shorter than the convolution's window. Under sequence-data
parallelism: tests/test_mamba_sequence_data_parallel.py."""

import pytest
from mamba_reference import build, reference_forward
from test_mamba import CASES

from blockzoo_ssm import SSMCarry
from blockzoo_testing import ConformanceError, RecurrentSliceTests, check_recurrent_slices

TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


class TestMambaSlices(RecurrentSliceTests):
    cases = CASES
    build = staticmethod(build)
    reference_forward = staticmethod(reference_forward)
    tolerance = TOLERANCE
    reference_cases = ("standard-biases-norms", "grouped-repeat-after-no-biases")
    reference_tolerance = {"atol": 2e-6, "rtol": 1e-5}
    carry_case = "grouped-repeat-before"
    carry_type = SSMCarry
    generation_carry = staticmethod(lambda state: (state.convolution[0].T, state.ssm[0]))


def test_the_check_sees_a_slice_that_forgets_the_state_before_it():
    """A forward_slice that drops the scan's state at each slice boundary (the convolution's carry kept) fails each
    part of the check: against the reference, and its final carry against generation's state."""
    layer = build(CASES["standard-biases-norms"])
    forward_slice = layer.forward_slice

    def forgetful(hidden, batch, carry):
        output, carry = forward_slice(hidden, batch, carry)
        return output, SSMCarry(carry.convolution, carry.state.zero_())

    layer.forward_slice = forgetful
    with pytest.raises(ConformanceError, match=r"the output of slices of 4 tokens against the reference differs"):
        check_recurrent_slices(layer, reference_forward=reference_forward, reference_tolerance=TOLERANCE)
    with pytest.raises(ConformanceError, match=r"^the carry's state differs"):
        check_recurrent_slices(layer, slice_lengths=(4,), generation_carry=lambda s: (s.convolution[0].T, s.ssm[0]))
