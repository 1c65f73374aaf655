"""The discrete Mamba 2 mixer over slices of longer sequences (`forward_slice`, micro-sequences on one process), by
the kit's `check_recurrent_slices` (through `RecurrentSliceTests`): the slices run one after the other, each taking
the carry of the one before, give the whole forward's output and every gradient (input and parameters), the float64
per-token loop's output, and a carry equal to what generation keeps. Documents straddle slice boundaries, are shorter
than a slice, have one token, and end on a slice boundary; slices of one token are shorter than the convolution's
window."""

from dm2_reference import build, reference_forward
from test_discrete_mamba_2 import CASES

from blockzoo_ssm import SSMCarry
from blockzoo_testing import RecurrentSliceTests


class TestDiscreteMamba2Slices(RecurrentSliceTests):
    cases = CASES
    build = staticmethod(build)
    reference_forward = staticmethod(reference_forward)
    tolerance = {"atol": 1e-5, "rtol": 1e-5}
    reference_cases = ("one-group-silu-kernel-2", "z-bias-no-conv-bias-mha")
    reference_tolerance = {"atol": 1e-5, "rtol": 1e-5}
    carry_case = "grouped-identity"
    carry_type = SSMCarry
    generation_carry = staticmethod(lambda state: (state.conv[0].T, state.ssm[0]))
