"""GPU kernels against the CPU path (the `torch` kernel in fp32): outputs and gradients over packed documents,
windows, GQA/MQA, and KV-cache decoding. Run on a GPU machine (skipped without CUDA).

Tolerances are relative errors ‖x − reference‖ / ‖reference‖: fp32 1e-3 (kernels may use TF32), bf16 2e-2 for
outputs and 3e-2 for gradients (bf16 keeps 8 bits of mantissa; errors add up over the projections).
A kernel that cannot run here fails with its reason rather than skipping.
"""

from functools import partial

import pytest
import torch
from attention_reference import SEED, build

from blockzoo_attention.kernels import KERNELS, select_kernel
from blockzoo_testing import CudaComparison

pytestmark = pytest.mark.gpu

HIDDEN = 64
CASES = {
    "gqa-window-llama3": {
        "heads": 4,
        "head_groups": 2,
        "head_size": 32,
        "window_size": 16,
        "rotary": {"type": "llama3", "theta": 1000.0, "original_context_length": 64},
    },
    "mha-causal-norms": {"heads": 4, "head_size": 32, "query_norm": {"type": "rms_norm"}, "key_norm": {}},
    "mqa-non-causal": {"heads": 4, "head_groups": 1, "head_size": 32, "causal": False, "softmax_scale": 0.3},
}
KERNEL_DTYPES = [("torch", torch.float32), ("torch", torch.bfloat16), ("flex", torch.float32)]
KERNEL_DTYPES += [("flex", torch.bfloat16), ("varlen", torch.bfloat16), ("batched", torch.bfloat16)]
OUTPUT_TOLERANCE = {torch.float32: {"relative": 1e-3}, torch.bfloat16: {"relative": 2e-2}}
GRADIENT_TOLERANCE = {torch.float32: {"relative": 1e-3}, torch.bfloat16: {"relative": 3e-2}}
CUDA = CudaComparison(partial(build, hidden=HIDDEN), SEED, OUTPUT_TOLERANCE, GRADIENT_TOLERANCE)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("implementation", "dtype"), KERNEL_DTYPES, ids=lambda value: str(value))
def test_kernel_matches_the_cpu_path(case, implementation, dtype):
    CUDA.check_matches_cpu({**CASES[case], "implementation": implementation}, dtype, cpu_config=CASES[case])


@pytest.mark.parametrize("case", CASES)
def test_batched_kernel_on_documents_of_one_length(case):
    """The batched path (SDPA over [documents, heads, length, head_size]) where every document has one length."""
    config = {**CASES[case], "window_size": None}
    CUDA.check_matches_cpu({**config, "implementation": "batched"}, torch.bfloat16, cpu_config=config, lengths=[64] * 3)


@pytest.mark.parametrize(("implementation", "dtype"), [("varlen", torch.bfloat16), ("flex", torch.bfloat16)])
def test_kv_cache_decoding_equals_the_full_forward(implementation, dtype):
    CUDA.check_decoding({**CASES["gqa-window-llama3"], "implementation": implementation}, dtype)


def test_auto_picks_the_gpu_kernels():
    bf16 = torch.zeros(4, 2, 64, device="cuda", dtype=torch.bfloat16)
    assert select_kernel("auto", bf16) is KERNELS["batched"], KERNELS["batched"].unavailable(bf16)
    assert select_kernel("auto", bf16.float()) is KERNELS["torch"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("implementation", ["varlen", "batched"])
def test_padded_batches_equal_exact_ones(case, implementation):
    """What `training.cuda_graphs` runs: empty documents first, max_length a bound."""
    CUDA.check_padded_batch({**CASES[case], "implementation": implementation})
