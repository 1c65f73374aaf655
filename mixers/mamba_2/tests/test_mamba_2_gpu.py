"""The Mamba 2 mixer on CUDA (the SSD scan through mamba_ssm's Triton kernels when installed, the time step computed
inside it; the convolution through blockzoo's Triton kernels) against the same mixer on the CPU path in fp32:
outputs and gradients over packed documents, and bf16 within a loose tolerance; decoding on CUDA (the state path)
against the full forward (the kernel path); each output-norm variant; and with `recompute_convolution` (the
convolution recomputed in the backward pass, `blockzoo_ssm.convolved_ssd_scan`) against the same CPU path. Run on
a GPU machine (skipped without CUDA).

Tolerances are relative errors ‖x − reference‖ / ‖reference‖ (those of core/tests/test_ssm_gpu.py): fp32 5e-3 for
outputs and 1e-2 for gradients (mamba_ssm's kernels multiply fp32 in TF32, about 1e-3 each), bf16 3e-2 and 5e-2
(bf16 keeps 8 bits of mantissa; the scan and projections add errors up).
"""

from functools import partial

import pytest
import torch
from mamba_2_reference import AROUND_ONE, RANDOM, SEED, build

from blockzoo_testing import CudaComparison

pytestmark = pytest.mark.gpu

HIDDEN = 64
CASES = {
    "groups-per-group-norm": {
        "heads": 8,
        "head_size": 16,
        "groups": 2,
        "state_size": 16,
        "chunk_size": 32,
        "convolution": {"bias": RANDOM},
        "normalization": {"weight": AROUND_ONE},
    },
    "whole-norm-d-per-channel-dt-limit-biases": {
        "heads": 4,
        "head_size": 32,
        "groups": 1,
        "state_size": 32,
        "chunk_size": 64,
        "normalization": {"per_group": False},
        "d_per_channel": True,
        "d": RANDOM,
        "dt_limit": [0.01, 0.5],
        "add_linear_biases": True,
    },
    # The Triton convolution with 3 taps and no bias, groups of 4 (channels 64 + 2·4·8 = 128).
    "kernel-3-no-conv-bias-4-groups": {
        "heads": 8,
        "head_size": 8,
        "groups": 4,
        "state_size": 8,
        "chunk_size": 16,
        "convolution": {"kernel_size": 3, "bias": {"enabled": False}},
    },
    # The output norm's variants: normalize, then gate (mamba_ssm's fused norm with norm_before_gate); no norm.
    "norm-before-gate": {
        "heads": 8,
        "head_size": 16,
        "groups": 2,
        "state_size": 16,
        "chunk_size": 32,
        "normalization": {"norm_before_gate": True, "weight": AROUND_ONE},
    },
    "no-norm": {
        "heads": 8,
        "head_size": 16,
        "groups": 2,
        "state_size": 16,
        "chunk_size": 32,
        "normalization": {"enabled": False},
    },
}
OUTPUT_TOLERANCE = {torch.float32: {"relative": 5e-3}, torch.bfloat16: {"relative": 3e-2}}
GRADIENT_TOLERANCE = {torch.float32: {"relative": 1e-2}, torch.bfloat16: {"relative": 5e-2}}
# Slices of the 256 tokens: documents straddle them; 2 is shorter than the convolution's window. The kernels in
# TF32 chunk the slices differently from the whole batch.
SLICE_LENGTHS = (2, 64)
SLICE_TOLERANCE = {"relative": 1e-2}
CUDA = CudaComparison(partial(build, hidden=HIDDEN), SEED, OUTPUT_TOLERANCE, GRADIENT_TOLERANCE)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recompute", [False, True], ids=["", "recompute_convolution"])
def test_cuda_matches_the_cpu_path(case, dtype, recompute):
    config = {**CASES[case], "recompute_convolution": recompute}  # the CPU reference: the plain path
    CUDA.check_matches_cpu(config, dtype, cpu_config=CASES[case])


@pytest.mark.parametrize("case", CASES)
def test_cuda_slices_equal_the_whole_forward(case):
    """forward_slice on CUDA (mamba_ssm's SSD kernel from an initial state, with its final state; the Triton
    convolution reading the inputs before the slice) over consecutive slices against the whole CUDA forward."""
    CUDA.check_slices(CASES[case], SLICE_LENGTHS, SLICE_TOLERANCE)


@pytest.mark.parametrize("case", ["groups-per-group-norm", "norm-before-gate", "no-norm"])
def test_cuda_decoding_equals_the_full_forward(case):
    CUDA.check_decoding(CASES[case])


def test_the_kernels_are_installed():
    """On CUDA the scan should take mamba_ssm's Triton kernels: the plugin's environment check says if not."""
    from blockzoo_mamba_2.plugin import check_environment

    assert check_environment() == []


@pytest.mark.parametrize("case", CASES)
def test_padded_batches_equal_exact_ones(case):
    """What `training.cuda_graphs` runs: empty documents first, max_length a bound."""
    CUDA.check_padded_batch(CASES[case])
