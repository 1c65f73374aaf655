"""The mixer on CUDA (the selective scan takes blockzoo's Triton kernel there) against the same mixer on the CPU
path: outputs and gradients over packed documents, both layouts, fp32 and bf16; generation on CUDA against the
full forward. Run on a GPU machine (skipped without CUDA).

Tolerances are relative errors ‖x − reference‖ / ‖reference‖: fp32 1e-3 (kernels may use TF32); bf16 3e-2 for
outputs and 5e-2 for gradients (bf16 keeps 8 bits of mantissa; errors add up over the projections and the scan).
"""

from functools import partial

import pytest
import torch
from mamba_reference import SEED, build

from blockzoo_testing import CudaComparison

pytestmark = pytest.mark.gpu

HIDDEN = 64
RANDOM_BIAS = {"bias": {"initialization": {"type": "normal", "std": 0.5}}}
CASES = {
    "standard-norms": {
        "state_size": 16,
        "convolution": RANDOM_BIAS,
        "dt_norm": {"type": "rms_norm"},
        "b_norm": {"type": "rms_norm"},
        "c_norm": {"type": "rms_norm"},
    },
    "grouped": {"state_size": 16, "inner_size": 128, "xb_size": 32, "add_linear_biases": True},
    "grouped-repeat-after": {"state_size": 8, "inner_size": 96, "xb_size": 32, "repeat_xb_before_convolution": False},
}
OUTPUT_TOLERANCE = {torch.float32: {"relative": 1e-3}, torch.bfloat16: {"relative": 3e-2}}
GRADIENT_TOLERANCE = {torch.float32: {"relative": 1e-3}, torch.bfloat16: {"relative": 5e-2}}
# Slices of the 256 tokens: documents straddle them; 2 is shorter than the convolution's window.
SLICE_LENGTHS = (2, 64)
SLICE_TOLERANCE = {"relative": 1e-3}
CUDA = CudaComparison(partial(build, hidden=HIDDEN), SEED, OUTPUT_TOLERANCE, GRADIENT_TOLERANCE)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_matches_the_cpu_path(case, dtype, monkeypatch):
    import blockzoo_ssm.triton_selective_scan as triton_selective_scan  # imports triton: CUDA machines only

    calls = []
    kernel = triton_selective_scan.selective_scan_triton
    monkeypatch.setattr(
        triton_selective_scan, "selective_scan_triton", lambda *a, **k: calls.append(1) or kernel(*a, **k)
    )
    CUDA.check_matches_cpu(CASES[case], dtype)
    assert calls, "the CUDA forward did not take the Triton selective scan"


@pytest.mark.parametrize("case", ["standard-norms", "grouped-repeat-after"])
def test_generation_on_cuda_equals_the_full_forward(case):
    CUDA.check_decoding(CASES[case])


@pytest.mark.parametrize("case", CASES)
def test_cuda_slices_equal_the_whole_forward(case):
    """forward_slice on CUDA (the Triton selective scan from an initial state, with final states; the Triton
    convolution reading the inputs before the slice) over consecutive slices against the whole CUDA forward."""
    CUDA.check_slices(CASES[case], SLICE_LENGTHS, SLICE_TOLERANCE)


@pytest.mark.parametrize("case", CASES)
def test_padded_batches_equal_exact_ones(case):
    """What `training.cuda_graphs` runs: empty documents first, max_length a bound."""
    CUDA.check_padded_batch(CASES[case])
