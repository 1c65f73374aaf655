"""The mixer on CUDA (where blockzoo_ssm takes mamba_ssm's Triton SSD kernel when it is importable) against the same
mixer on the CPU path: outputs and gradients over packed documents, fp32 and bf16, and decoding on CUDA against the
full forward. Run on a GPU machine (skipped without CUDA).

Tolerances are relative errors ‖x − reference‖ / ‖reference‖: fp32 2e-3 (the Triton kernels may use TF32), bf16
3e-2 for outputs and 5e-2 for gradients (8 bits of mantissa, errors adding up over the projections and the scan).
"""

from functools import partial

import pytest
import torch
from dm2_reference import SEED, build

from blockzoo_testing import CudaComparison

pytestmark = pytest.mark.gpu

HIDDEN = 64
CASES = {
    "grouped-identity": {"heads": 8, "groups": 2, "head_size": 16, "state_size": 16, "chunk_size": 64},
    "silu-biases": {
        "heads": 4,
        "groups": 4,
        "head_size": 32,
        "state_size": 32,
        "chunk_size": 64,
        "activation": "silu",
        "add_linear_biases": True,
        "convolution": {"kernel_size": 3},
    },
}
OUTPUT_TOLERANCE = {torch.float32: {"relative": 2e-3}, torch.bfloat16: {"relative": 3e-2}}
GRADIENT_TOLERANCE = {torch.float32: {"relative": 2e-3}, torch.bfloat16: {"relative": 5e-2}}
# Slices of the 256 tokens: documents straddle them; 2 is shorter than the convolution's window. The kernels in
# TF32 chunk the slices differently from the whole batch.
SLICE_LENGTHS = (2, 64)
SLICE_TOLERANCE = {"relative": 5e-3}
CUDA = CudaComparison(partial(build, hidden=HIDDEN), SEED, OUTPUT_TOLERANCE, GRADIENT_TOLERANCE)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_matches_the_cpu_path(case, dtype):
    CUDA.check_matches_cpu(CASES[case], dtype)


@pytest.mark.parametrize("case", CASES)
def test_cuda_slices_equal_the_whole_forward(case):
    """forward_slice on CUDA (mamba_ssm's SSD kernel from an initial state, with its final state; the Triton
    convolution reading the inputs before the slice) over consecutive slices against the whole CUDA forward."""
    CUDA.check_slices(CASES[case], SLICE_LENGTHS, SLICE_TOLERANCE)


def test_cuda_decoding_equals_the_full_forward():
    CUDA.check_decoding(CASES["grouped-identity"])


@pytest.mark.parametrize("case", CASES)
def test_padded_batches_equal_exact_ones(case):
    """What `training.cuda_graphs` runs: empty documents first, max_length a bound."""
    CUDA.check_padded_batch(CASES[case])
