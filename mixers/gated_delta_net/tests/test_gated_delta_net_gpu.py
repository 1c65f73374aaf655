"""The Gated DeltaNet mixer on CUDA (the delta rule through flash-linear-attention's Triton kernel when installed;
the convolution through blockzoo's Triton kernels) against the same mixer on the CPU torch path in fp32: outputs and
gradients over packed documents, and bf16 within a loose tolerance; decoding on CUDA (the state path: fla's kernel
from a state for prompts and chunks, the torch recurrence for one-token steps) against the full forward. Run on a GPU
machine (skipped without CUDA).

Tolerances are relative errors ‖x − reference‖ / ‖reference‖, those of the Mamba 2 GPU tests: fp32 5e-3 for outputs
and 1e-2 for gradients (Triton multiplies fp32 in TF32), bf16 3e-2 and 5e-2.
"""

from functools import partial

import pytest
import torch
from gated_delta_net_reference import AROUND_ONE, RANDOM, SEED, STRONG_DECAY, build

from blockzoo_testing import CudaComparison

pytestmark = pytest.mark.gpu

HIDDEN = 64
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
CUDA = CudaComparison(partial(build, hidden=HIDDEN), SEED, OUTPUT_TOLERANCE, GRADIENT_TOLERANCE)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_matches_the_cpu_path(case, dtype):
    CUDA.check_matches_cpu(CASES[case], dtype)


@pytest.mark.parametrize("case", CASES)
def test_cuda_decoding_equals_the_full_forward(case):
    CUDA.check_decoding(CASES[case])


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
    CUDA.check_padded_batch(CASES[case])


# blockzoo's Triton kernels at a realistic shape: 2 documents of 1000 and 3000 tokens (odd, not chunk multiples),
# 4 key heads × 128 read by 8 value heads × 128, bf16 q, k, v, β, fp32 decays and initial states.
KERNEL_SHAPE = {"lengths": [1000, 3000], "key_heads": 4, "heads": 8, "key_size": 128, "value_size": 128}
# Against float64 on the same rounded inputs; tl.dot multiplies fp32 in TF32 (10-bit mantissas): fla's class.
KERNEL_TOLERANCE = 2e-2


def _kernel_inputs(lengths, key_heads, heads, key_size, value_size):
    generator = torch.Generator(device="cuda").manual_seed(SEED)
    tokens = sum(lengths)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device="cuda")

    q = torch.nn.functional.normalize(randn(tokens, key_heads, key_size), dim=-1) * key_size**-0.5
    k = torch.nn.functional.normalize(randn(tokens, key_heads, key_size), dim=-1)
    g = -torch.nn.functional.softplus(randn(tokens, heads)) * 0.2
    beta = torch.sigmoid(randn(tokens, heads)).bfloat16()
    initial = randn(len(lengths), heads, key_size, value_size) * 0.1
    cu_seqlens = torch.tensor([0, *lengths], device="cuda").cumsum(0).int()
    return [q.bfloat16(), k.bfloat16(), randn(tokens, heads, value_size).bfloat16(), g, beta, initial], cu_seqlens


def test_our_kernels_match_float64_at_a_realistic_shape():
    """Outputs, final states and every input's gradient of `triton_gated_delta_rule` against the torch chunked form
    in float64 (itself checked against the per-token loop in test_gated_delta_net.py)."""
    from blockzoo.layers.base import Batch
    from blockzoo_gated_delta_net.delta_rule import chunked_gated_delta_rule
    from blockzoo_gated_delta_net.triton_delta_rule import triton_gated_delta_rule

    inputs, cu_seqlens = _kernel_inputs(**KERNEL_SHAPE)
    leaves = [x.clone().requires_grad_() for x in inputs]
    output, final = triton_gated_delta_rule(*leaves[:5], cu_seqlens, leaves[5])
    weights = [torch.randn_like(x, dtype=torch.float64) for x in (output, final)]
    ((output.double() * weights[0]).sum() + (final.double() * weights[1]).sum()).backward()

    references = [x.double().requires_grad_() for x in inputs]
    group = KERNEL_SHAPE["heads"] // KERNEL_SHAPE["key_heads"]
    q, k = (x.repeat_interleave(group, dim=1) for x in references[:2])
    batch = Batch(KERNEL_SHAPE["lengths"], device="cuda")
    expected, expected_final = chunked_gated_delta_rule(
        q, k, *references[2:5], batch, chunk_size=64, initial=references[5]
    )
    ((expected * weights[0]).sum() + (expected_final * weights[1]).sum()).backward()
    pairs = {"output": (output, expected), "final": (final, expected_final)}
    pairs |= {
        name: (leaf.grad, reference.grad)
        for name, leaf, reference in zip(["q", "k", "v", "g", "beta", "initial"], leaves, references)
    }
    for name, (got, reference) in pairs.items():
        error = ((got.double() - reference).norm() / reference.norm()).item()
        assert error < KERNEL_TOLERANCE, f"{name}: relative error {error:.2e}"


def test_our_kernels_forward_matches_fla():
    """The same inputs through fla's `chunk_gated_delta_rule` (its forward, allowed everywhere): output and final
    states."""
    pytest.importorskip("fla")
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from blockzoo_gated_delta_net.triton_delta_rule import triton_gated_delta_rule

    inputs, cu_seqlens = _kernel_inputs(**KERNEL_SHAPE)
    group = KERNEL_SHAPE["heads"] // KERNEL_SHAPE["key_heads"]
    with torch.no_grad():
        ours = triton_gated_delta_rule(*inputs[:5], cu_seqlens, inputs[5])
        q, k = (x.repeat_interleave(group, dim=1) for x in inputs[:2])
        theirs = chunk_gated_delta_rule(
            q[None], k[None], inputs[2][None], inputs[3][None], inputs[4][None], scale=1.0,
            initial_state=inputs[5], output_final_state=True, cu_seqlens=cu_seqlens.long(),
        )  # fmt: skip
    for got, expected in zip(ours, (theirs[0][0], theirs[1])):
        error = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
        assert error < KERNEL_TOLERANCE, error


def test_training_on_cuda_takes_a_kernel_with_a_backward():
    """Where fla refuses its backward, the layer trains through blockzoo's Triton kernels (not the torch path)."""
    from blockzoo_gated_delta_net.delta_rule import choose_kernel, fla_available, fla_backward_refused

    q = torch.zeros(4, 2, 128, device="cuda", requires_grad=True)
    v = torch.zeros(4, 4, 128, device="cuda")
    expected = "fla" if fla_available() and not fla_backward_refused() else "triton"
    assert choose_kernel(q, v) == expected
    with torch.no_grad():
        assert choose_kernel(q, v) == ("fla" if fla_available() else "triton")
