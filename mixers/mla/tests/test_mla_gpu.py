"""The GPU kernels of the MLA mixer against its CPU path (the `torch` kernel in fp32): outputs and gradients over
packed documents with value heads narrower and wider than the query/key heads (the flash kernels get padded heads),
latent-cache decoding (expanded and absorbed) in bf16, and micro-sequences against the same kernel's whole forward.
Run on a GPU machine (skipped without CUDA).

Tolerances as the attention plugin's GPU tests: relative errors fp32 1e-3 (TF32), bf16 2e-2 outputs, 3e-2 gradients.
"""

from functools import partial

import pytest
import torch
from mla_reference import SEED, build

from blockzoo_testing import CudaComparison

pytestmark = pytest.mark.gpu

HIDDEN = 64
CASES = {
    # DeepSeek-V3's proportions, small: nope 32 + rotary 16 = 48 per query/key head, values of 32.
    "low-rank-query-interleaved": {
        "heads": 4,
        "query_rank": 48,
        "key_value_rank": 32,
        "nope_head_size": 32,
        "rotary_head_size": 16,
        "value_head_size": 32,
        "interleaved_rotary": True,
        "rotary": {"theta": 1000.0},
    },
    "value-wider-than-query-key": {
        "heads": 4,
        "key_value_rank": 32,
        "nope_head_size": 8,
        "rotary_head_size": 16,
        "value_head_size": 40,
    },
}
KERNEL_DTYPES = [("torch", torch.float32), ("torch", torch.bfloat16), ("flex", torch.bfloat16)]
KERNEL_DTYPES += [("varlen", torch.bfloat16), ("batched", torch.bfloat16)]
OUTPUT_TOLERANCE = {torch.float32: {"relative": 1e-3}, torch.bfloat16: {"relative": 2e-2}}
GRADIENT_TOLERANCE = {torch.float32: {"relative": 1e-3}, torch.bfloat16: {"relative": 3e-2}}
CUDA = CudaComparison(partial(build, hidden=HIDDEN), SEED, OUTPUT_TOLERANCE, GRADIENT_TOLERANCE)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("implementation", "dtype"), KERNEL_DTYPES, ids=lambda value: str(value))
def test_kernel_matches_the_cpu_path(case, implementation, dtype):
    CUDA.check_matches_cpu({**CASES[case], "implementation": implementation}, dtype, cpu_config=CASES[case])


@pytest.mark.parametrize("case", CASES)
def test_batched_kernel_on_documents_of_one_length(case):
    config = {**CASES[case], "implementation": "batched"}
    CUDA.check_matches_cpu(config, torch.bfloat16, cpu_config=CASES[case], lengths=[64] * 3)


@pytest.mark.parametrize("absorbed", [True, False])
def test_latent_cache_decoding_equals_the_full_forward(absorbed):
    CUDA.check_decoding({**CASES["low-rank-query-interleaved"], "absorbed_decoding": absorbed}, torch.bfloat16)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("implementation", ["varlen", "batched", "torch"])
def test_kernels_over_slices_give_their_whole_forward(case, implementation):
    """Micro-sequences of 64 tokens in bf16 (each attending to the carried latents, varlen's keys as segments of the
    stretch) against the same kernel's whole forward."""
    config = {**CASES[case], "implementation": implementation}
    CUDA.check_slices(config, [64], {"relative": 3e-2}, dtype=torch.bfloat16, compute_dtype="bf16")
