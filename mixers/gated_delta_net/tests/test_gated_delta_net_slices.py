"""The Gated DeltaNet mixer over slices of longer sequences (`forward_slice`, micro-sequences on one process), by the
kit's `check_recurrent_slices`: the slices run one after the other, each taking the carry of the one before, give the
whole forward's output and every gradient (input and parameters), the float64 reference's output, and a carry equal
to what generation keeps. Documents straddle slice boundaries, are shorter than a slice, have one token, and end on a
slice boundary. Under sequence-data parallelism: test_gated_delta_net_sequence_data_parallel.py."""

from gated_delta_net_reference import AROUND_ONE, STRONG_DECAY, build, reference_forward

from blockzoo_ssm import SSMCarry
from blockzoo_testing import RecurrentSliceTests

# fp32: the gradients reach ~80 here (strong decays), and their differences from the whole forward are ~2e-6 of
# their norms (in float64 ~5e-9, the decays being computed in fp32 by design both ways).
TOLERANCE = {"atol": 2e-4, "rtol": 1e-4}
CASES = {
    "grouped-values-short-chunks": {
        "key_heads": 2,
        "value_heads": 4,
        "key_head_size": 4,
        "value_head_size": 3,
        "chunk_size": 4,
        **STRONG_DECAY,
        "normalization": {"weight": AROUND_ONE},
    },
    "one-value-head-per-key-conv-bias": {
        "key_heads": 2,
        "value_heads": 2,
        "key_head_size": 5,
        "value_head_size": 4,
        "convolution": {"kernel_size": 3, "bias": {"enabled": True}},
        **STRONG_DECAY,
    },
}


class TestGatedDeltaNetSlices(RecurrentSliceTests):
    cases = CASES
    build = staticmethod(build)
    reference_forward = staticmethod(reference_forward)
    tolerance = TOLERANCE
    reference_cases = ("grouped-values-short-chunks",)
    reference_tolerance = {"atol": 2e-5, "rtol": 1e-4}
    carry_case = "grouped-values-short-chunks"
    carry_type = SSMCarry
    generation_carry = staticmethod(lambda state: (state.convolution[0].T, state.recurrent[0]))
