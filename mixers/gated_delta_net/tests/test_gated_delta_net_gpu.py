"""The Gated DeltaNet mixer on CUDA (the delta rule through flash-linear-attention's Triton kernel when installed;
the convolution through blockzoo's Triton kernels) against the same mixer on the CPU torch path in fp32: outputs and
gradients over packed documents, and bf16 within a loose tolerance; decoding on CUDA (the state path: fla's kernel
from a state for prompts and chunks, the torch recurrence for one-token steps) against the full forward. Run on a GPU
machine (skipped without CUDA).

Tolerances are relative errors ‖x − reference‖ / ‖reference‖, those of the Mamba 2 GPU tests: fp32 5e-3 for outputs
and 1e-2 for gradients (Triton multiplies fp32 in TF32), bf16 3e-2 and 5e-2.
"""

import pytest
import torch
from gated_delta_net_reference import AROUND_ONE, RANDOM, SEED, STRONG_DECAY, build

from blockzoo.testing import check_decoding, check_matches_layer, check_padded_batch, single_process

pytestmark = pytest.mark.gpu

HIDDEN = 64
LENGTHS = [37, 1, 90, 128]  # Not multiples of the chunk size (64).
CASES = {
    "grouped-values": {
        "key_heads": 2,
        "value_heads": 4,
        "key_head_size": 32,
        "value_head_size": 16,
        **STRONG_DECAY,
        "normalization": {"weight": AROUND_ONE},
    },
    "one-value-head-per-key-conv-bias-biases": {
        "key_heads": 4,
        "value_heads": 4,
        "key_head_size": 16,
        "value_head_size": 32,
        "add_linear_biases": True,
        "convolution": {"kernel_size": 3, "bias": {"enabled": True, **RANDOM}},
    },
}
OUTPUT_TOLERANCE = {torch.float32: {"relative": 5e-3}, torch.bfloat16: {"relative": 3e-2}}
GRADIENT_TOLERANCE = {torch.float32: {"relative": 1e-2}, torch.bfloat16: {"relative": 5e-2}}
# Prefill prompts of different lengths, a chunk, then one token at a time.
DECODING = {"lengths": [40, 29], "steps": [[36, 20], [2, 7], [1, 1], [1, 1]]}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_matches_the_cpu_path(case, dtype):
    check_matches_layer(
        build(CASES[case], single_process(SEED, backend="nccl"), hidden=HIDDEN),
        build(CASES[case], hidden=HIDDEN),
        lengths=LENGTHS,
        dtype=dtype,
        output_tolerance=OUTPUT_TOLERANCE[dtype],
        gradient_tolerance=GRADIENT_TOLERANCE[dtype],
    )


@pytest.mark.parametrize("case", CASES)
def test_cuda_decoding_equals_the_full_forward(case):
    layer = build(CASES[case], single_process(SEED, backend="nccl"), hidden=HIDDEN)
    check_decoding(layer, tolerance=OUTPUT_TOLERANCE[torch.float32], **DECODING)


def test_the_kernel_is_installed_and_taken():
    """On CUDA the delta rule should take fla's kernel: the plugin's environment check says if not. With gradients
    it does only where fla's backward runs (fla 0.6 refuses it on Hopper with Triton < 3.7.1 without tilelang)."""
    from blockzoo_gated_delta_net.delta_rule import fla_backward_refused, uses_fla_kernel
    from blockzoo_gated_delta_net.plugin import check_environment

    assert check_environment() == []
    assert uses_fla_kernel(torch.zeros(1, device="cuda"))
    wanting_gradients = torch.zeros(1, device="cuda", requires_grad=True)
    assert uses_fla_kernel(wanting_gradients) == (not fla_backward_refused())


@pytest.mark.parametrize("initial_state", [False, True], ids=["from-zero", "from-a-state"])
def test_fla_forward_matches_the_torch_path(initial_state):
    """Without gradients the CUDA path is fla's kernel wherever it imports: its output and final state against the
    torch chunked form of the same inputs on the CPU (fp32)."""
    from blockzoo.layers.base import Batch
    from blockzoo_gated_delta_net.delta_rule import gated_delta_rule, uses_fla_kernel

    generator = torch.Generator().manual_seed(SEED)
    lengths, key_heads, value_heads, key_size, value_size = [70, 1, 129], 2, 4, 32, 16
    tokens = sum(lengths)
    q, k = (torch.randn(tokens, key_heads, key_size, generator=generator) for _ in range(2))
    v = torch.randn(tokens, value_heads, value_size, generator=generator)
    g = -torch.rand(tokens, value_heads, generator=generator)  # log decay in (-1, 0]
    beta = torch.rand(tokens, value_heads, generator=generator)
    state = torch.randn(len(lengths), value_heads, key_size, value_size, generator=generator) * initial_state
    results = {}
    for device in ("cpu", "cuda"):
        inputs = [tensor.to(device) for tensor in (q, k, v, g, beta)]
        final = state.to(device).clone()
        with torch.no_grad():
            assert uses_fla_kernel(*inputs) == (device == "cuda")
            output = gated_delta_rule(*inputs, Batch(lengths, device=device), state=final)
        results[device] = (output.cpu(), final.cpu())
    for got, expected in zip(results["cuda"], results["cpu"]):
        assert ((got - expected).norm() / expected.norm()).item() < OUTPUT_TOLERANCE[torch.float32]["relative"]


@pytest.mark.parametrize("case", CASES)
def test_padded_batches_equal_exact_ones(case):
    """What `training.cuda_graphs` runs: empty documents first, max_length a bound."""
    layer = build(CASES[case], single_process(SEED, backend="nccl"), hidden=HIDDEN)
    check_padded_batch(layer, lengths=LENGTHS, dtype=torch.bfloat16, tolerance={"relative": 1e-2})
