"""blockzoo's Triton kernels of the gated delta rule (`triton_delta_rule`) against the float64 per-token loop of
`gated_delta_net_reference`: the output, the final states and the gradient of every input (q, k, v, g, β, the
initial states), over packed documents of odd lengths, documents shorter than a chunk and one-token ones, several
and grouped heads, with and without initial states, fp32 and bf16 inputs.

The kernels run under Triton's interpreter on CPU tensors, in a subprocess of this file (the interpreter is chosen
when the kernels are defined, from TRITON_INTERPRET). The interpreter is slow: the fast cases use heads of 16 to 32
channels and a few chunks; a longer one is marked slow. Errors are relative: ‖value − reference‖ / ‖reference‖.
"""

import os
import sys

import pytest
import torch
from gated_delta_net_reference import delta_rule_loop

from blockzoo_testing.triton_interpreter import patch_bf16_dots, patch_for_numpy, run_interpreter_cases

# (lengths, key_heads, value_heads, key_size, value_size, with initial states, dtype[, the largest log decay's
# magnitude, 0.5 by default]). Chunks of 64 tokens.
FAST_CASES = [
    ((5, 3), 1, 1, 16, 16, True, torch.float32),
    ((0, 0, 7), 1, 2, 16, 16, True, torch.float32),  # empty documents first, as padded batches have
    # Grouped heads; a document crossing a chunk's end, with weak decays (at most 0.05 a token): the chunk's rows
    # still reach one another across its 64 tokens, so every 16-row block of T = (I + A)⁻¹ weighs.
    ((1, 66, 9), 2, 4, 32, 32, False, torch.float32, 0.05),
    ((37, 1), 1, 2, 24, 16, True, torch.bfloat16),  # a key head size that is no power of two
    ((37, 1), 1, 1, 24, 16, True, torch.bfloat16),  # one value head per key head: q's and k's gradients written in bf16
    # Strong decays (log decays down to -4 a token): a chunk's cumulative decay passes e^-88 within the document,
    # so the chunk's rows past the document's end must not decay from zero (e^{b_t - b_s} would overflow there).
    ((50, 20), 1, 1, 16, 16, False, torch.float32, 4.0),
]
SLOW_CASES = [((70, 1, 130, 64), 2, 4, 32, 16, True, torch.float32)]
FP32_TOLERANCE = 1e-5
# bf16 q, k, v and β (the reference sees the same rounded values); the output is rounded to bf16.
BF16_TOLERANCE = 1e-2
# With what the kernels keep between them in bf16 too (`INTERMEDIATE_DTYPE`): each gradient passes through two or
# three bf16 roundings (u, du, the states and their gradients, dW, T's operands), each up to 2⁻⁸ relative.
BF16_INTERMEDIATES_TOLERANCE = 2e-2
NAMES = ("q", "k", "v", "g", "beta", "initial")


def relative_errors(lengths, key_heads, heads, key_size, value_size, with_initial, dtype, decay=0.5, seed=0):
    """{"output": error, "final": error, "q": error of dq, ...} of the kernels against the float64 loop."""
    from blockzoo_gated_delta_net.triton_delta_rule import triton_gated_delta_rule

    generator = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    inputs = [
        torch.nn.functional.normalize(randn(tokens, key_heads, key_size), dim=-1) * key_size**-0.5,
        torch.nn.functional.normalize(randn(tokens, key_heads, key_size), dim=-1),
        randn(tokens, heads, value_size),
        -torch.rand(tokens, heads, generator=generator) * decay,  # log decays
        torch.rand(tokens, heads, generator=generator),
        randn(len(lengths), heads, key_size, value_size),
    ]
    inputs = [x.to(dtype) if index in (0, 1, 2, 4) else x for index, x in enumerate(inputs)]
    leaves = [x.clone().requires_grad_() for x in inputs]
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0)
    output, final = triton_gated_delta_rule(*leaves[:5], cu_seqlens, leaves[5] if with_initial else None)
    output_weights = randn(*output.shape).double()
    final_weights = randn(*final.shape).double()
    ((output.double() * output_weights).sum() + (final.double() * final_weights).sum()).backward()

    references = [x.double().requires_grad_() for x in inputs]
    outputs, finals, start = [], [], 0
    for document, length in enumerate(lengths):
        rows = slice(start, start + length)
        initial = references[5][document] if with_initial else None
        document_output, document_final = delta_rule_loop(*(x[rows] for x in references[:5]), initial)
        outputs.append(document_output)
        finals.append(document_final)
        start += length
    expected_output, expected_final = torch.cat(outputs), torch.stack(finals)
    ((expected_output * output_weights).sum() + (expected_final * final_weights).sum()).backward()

    def error(value, expected):
        return float((value.detach().double() - expected.detach()).norm() / expected.detach().norm())

    errors = {"output": error(output, expected_output), "final": error(final, expected_final)}
    for name, leaf, reference in zip(NAMES, leaves, references, strict=True):
        if name == "initial" and not with_initial:
            continue
        assert leaf.grad is not None and leaf.grad.dtype == leaf.dtype, name
        errors[name] = error(leaf.grad, reference.grad)
    return errors


def check_cases(cases, tolerance=None) -> list[str]:
    """One line per case and quantity beyond its tolerance (nothing when all pass): `tolerance`, else the one of the
    case's dtype."""
    failures = []
    for case in cases:
        allowed = tolerance or (BF16_TOLERANCE if case[6] == torch.bfloat16 else FP32_TOLERANCE)
        errors = relative_errors(*case)
        print(f"{case}: max relative error {max(errors.values()):.2e}", flush=True)
        failures += [f"{case}: {name} relative error {value:.2e} > {allowed}" for name, value in errors.items()
                     if not value <= allowed]  # fmt: skip
    return failures


def run_under_interpreter(which: str) -> None:
    """This file's `which` cases ("fast", "bf16-intermediates", "slow" or "layer") under Triton's interpreter.
    Overflows are errors: the kernels must compute nothing from memory they never wrote or rows they should have
    masked."""
    run_interpreter_cases(__file__, which, overflow_is_error=True)


def test_the_kernels_match_the_float64_loop():
    run_under_interpreter("fast")


def test_the_kernels_keeping_bf16_intermediates_match_the_float64_loop():
    """With what the kernels keep between them (W, U, the chunks' states, the new values and their gradients) in bf16,
    the default (`INTERMEDIATE_DTYPE`; the other checks keep them in fp32): every case with bf16 inputs within
    BF16_INTERMEDIATES_TOLERANCE, and with fp32 inputs (which keep fp32) within fp32's."""
    run_under_interpreter("bf16-intermediates")


@pytest.mark.slow
def test_the_kernels_match_the_float64_loop_over_several_chunks():
    run_under_interpreter("slow")


def test_the_chunk_layout_cuts_every_document_into_chunks():
    pytest.importorskip("triton")
    from blockzoo_gated_delta_net.triton_delta_rule import chunk_layout

    starts, ends, offsets = chunk_layout(torch.tensor([0, 0, 3, 131, 131, 195]), 64, tokens=195)
    # 195 // 64 + 5 documents = 8 slots (a bound known from the shape alone); the 4 past the last chunk are empty.
    assert starts.tolist() == [0, 3, 67, 131, 0, 0, 0, 0]
    assert ends.tolist() == [3, 67, 131, 195, 0, 0, 0, 0]
    assert offsets.tolist() == [0, 0, 1, 3, 3, 4]  # the empty documents have no chunk


def test_head_and_chunk_sizes_the_kernels_cannot_take_are_refused():
    pytest.importorskip("triton")
    from blockzoo_gated_delta_net.triton_delta_rule import triton_gated_delta_rule

    gates, cu_seqlens = torch.zeros(4, 1), torch.tensor([0, 4])
    for key_size, chunk_size in ((8, 64), (256, 64), (16, 128)):
        q, v = torch.zeros(4, 1, key_size), torch.zeros(4, 1, 16)
        expected = f"head sizes {key_size} \\(key\\) and 16 \\(value\\) and chunks of {chunk_size} tokens"
        with pytest.raises(ValueError, match=expected):
            triton_gated_delta_rule(q, q, v, gates, gates, cu_seqlens, chunk_size=chunk_size)


@pytest.mark.slow
def test_the_layer_and_its_slices_through_the_kernels():
    run_under_interpreter("layer")


# Shared memory per block on Hopper (H100, H200): 227 KiB. Triton reports a kernel's need when it compiles it.
HOPPER_SHARED_MEMORY = 232448
HOPPER_MULTIPROCESSOR_SHARED_MEMORY = 233472  # 228 KiB, shared by the blocks resident on one multiprocessor
# The kernels' pointer arguments that are not fp32: bf16 activations (the training case) and int32 chunk tables.
BF16_ARGUMENTS = ("q", "k", "v", "beta", "output", "output_gradient", "v_gradient")
# What the kernels keep between them, in INTERMEDIATE_DTYPE.
KEPT_ARGUMENTS = ("w", "u", "states", "new_values", "state_gradients", "new_value_gradients", "w_gradient")
INT32_ARGUMENTS = ("cu_seqlens", "chunk_offsets", "chunk_start", "chunk_end")


def shared_memory_on_hopper(kernel, options, block_v, block_k=None) -> int:
    """The shared memory `kernel` needs per block compiled for sm_90 (no GPU needed: Triton compiles for a named
    target) with the largest blocks the launches use: 128 key channels, `block_v` value channels, chunks of 64; bf16
    inputs, intermediates in INTERMEDIATE_DTYPE; `options` the launch's (num_warps, num_stages); `block_k` the kernel's
    block of key channels where it takes them in blocks. Arguments are declared divisible by 16, as the launches'
    are."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from blockzoo_gated_delta_net.triton_delta_rule import CHUNK_SIZE, INTERMEDIATE_DTYPE, MAX_KEY_SIZE

    constants = {"GROUP": 1, "CHUNK": CHUNK_SIZE, "BLOCK_K": block_k or MAX_KEY_SIZE, "BLOCK_V": block_v}
    constants |= {"HAS_INITIAL": True, "HAS_FINAL_GRADIENT": True}
    signature = {}
    for name in kernel.arg_names:
        stem = name.removesuffix("_pointer")
        if name in constants:
            signature[name] = "constexpr"
        elif name == stem:
            signature[name] = "i32"
        else:
            kept_in_bf16 = stem in KEPT_ARGUMENTS and INTERMEDIATE_DTYPE is torch.bfloat16
            bf16 = stem in BF16_ARGUMENTS or kept_in_bf16
            signature[name] = "*bf16" if bf16 else "*i32" if stem in INT32_ARGUMENTS else "*fp32"
    divisible = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names) if name not in constants}
    source = ASTSource(
        kernel, signature, constexprs={name: constants[name] for name in kernel.arg_names if name in constants},
        attrs=divisible,
    )  # fmt: skip
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(options)).metadata.shared


def test_the_kernels_fit_a_hopper_gpus_shared_memory():
    """Each kernel with its launch options, compiled for sm_90: within the 227 KiB a block may use (the interpreter
    never checks it; on the GPU a kernel past it fails to launch)."""
    pytest.importorskip("triton")
    from blockzoo_gated_delta_net import triton_delta_rule as launches
    from blockzoo_gated_delta_net.triton_backward import (
        chunk_key_gradients,
        chunk_new_value_gradients,
        chunk_wy_gradients,
        pass_state_gradients,
    )
    from blockzoo_gated_delta_net.triton_forward import chunk_outputs, pass_states
    from blockzoo_gated_delta_net.triton_prepare import prepare_chunks

    # (kernel, launch options, value channels a block, key channels a block where it takes them in blocks)
    per_chunk, per_pass, key_block = launches.CHUNK_VALUE_BLOCK, launches.VALUE_BLOCK, launches.KEY_BLOCK
    kernels = {
        "prepare_chunks": (prepare_chunks, launches.PREPARE_OPTIONS, per_chunk, None),
        "pass_states": (pass_states, launches.STATE_PASS_OPTIONS, per_pass, None),
        "chunk_outputs": (chunk_outputs, launches.CHUNK_OPTIONS, per_chunk, None),
        "chunk_new_value_gradients": (chunk_new_value_gradients, launches.CHUNK_OPTIONS, per_chunk, None),
        "pass_state_gradients": (pass_state_gradients, launches.STATE_PASS_OPTIONS, per_pass, None),
        "chunk_key_gradients": (chunk_key_gradients, launches.CHUNK_GRADIENT_OPTIONS, per_chunk, key_block),
        "chunk_wy_gradients": (chunk_wy_gradients, launches.WY_GRADIENT_OPTIONS, per_chunk, key_block),
    }
    needs = {name: shared_memory_on_hopper(*arguments) for name, arguments in kernels.items()}
    print(needs)
    assert all(0 < need <= HOPPER_SHARED_MEMORY for need in needs.values()), needs
    # The sequential passes run two programs to a multiprocessor (each block also reserves 1 KiB).
    for name in ("pass_states", "pass_state_gradients"):
        assert 2 * (needs[name] + 1024) <= HOPPER_MULTIPROCESSOR_SHARED_MEMORY, needs


def test_the_kernel_choice_on_the_cpu(monkeypatch):
    from blockzoo_gated_delta_net.delta_rule import KERNEL_VARIABLE, choose_kernel

    q, v = torch.zeros(4, 1, 16, requires_grad=True), torch.zeros(4, 2, 16)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(KERNEL_VARIABLE, raising=False)
    assert choose_kernel(q, v) == "torch"
    for forced in ("fla", "triton"):  # neither runs on CPU tensors without the interpreter
        monkeypatch.setenv(KERNEL_VARIABLE, forced)
        with pytest.raises(ValueError, match=f"{KERNEL_VARIABLE}={forced}: that kernel cannot run here"):
            choose_kernel(q, v)
    monkeypatch.setenv(KERNEL_VARIABLE, "cuda")
    with pytest.raises(ValueError, match="expected one of auto, fla, triton, torch"):
        choose_kernel(q, v)


# The layer through the kernels (forced, under the interpreter): heads of 16, chunks of 16, strong decays.
LAYER_CONFIG = {
    "key_heads": 1,
    "value_heads": 2,
    "key_head_size": 16,
    "value_head_size": 16,
    "chunk_size": 16,
}
LAYER_LENGTHS = (5, 1, 21, 5)  # a document over two chunks; 32 tokens in slices of 8 and 32


def check_layer() -> list[str]:
    """The layer forced onto the kernels: its outputs and every gradient against the same layer on the torch path,
    and its slices (micro-sequences, carries passed on) against its whole forward and the float64 reference."""
    from gated_delta_net_reference import STRONG_DECAY, build, reference_forward

    from blockzoo.layers.base import Batch
    from blockzoo_gated_delta_net.delta_rule import KERNEL_VARIABLE
    from blockzoo_testing import check_recurrent_slices

    layer = build({**LAYER_CONFIG, **STRONG_DECAY})
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(sum(LAYER_LENGTHS), layer.hidden_dim.global_size, generator=generator)
    weights = torch.randn(hidden.shape, generator=generator)
    runs = {}
    for kernel in ("torch", "triton"):
        os.environ[KERNEL_VARIABLE] = kernel
        layer.zero_grad()
        leaf = hidden.clone().requires_grad_()
        output = layer(leaf, Batch(list(LAYER_LENGTHS)))
        (output * weights).sum().backward()
        runs[kernel] = {"output": output.detach(), "input": leaf.grad}
        runs[kernel] |= {name: parameter.grad.clone() for name, parameter in layer.named_parameters()}
    failures = []
    for name, expected in runs["torch"].items():
        error = float((runs["triton"][name] - expected).norm() / expected.norm())
        print(f"layer through the kernels, {name}: relative error {error:.2e}", flush=True)
        if not error <= 1e-5:
            failures.append(f"the layer through the kernels: {name} relative error {error:.2e} > 1e-5")
    os.environ[KERNEL_VARIABLE] = "triton"
    try:
        check_recurrent_slices(
            layer,
            tolerance={"atol": 2e-4, "rtol": 1e-4},
            reference_forward=reference_forward,
            reference_tolerance={"atol": 2e-5, "rtol": 1e-4},
            lengths=LAYER_LENGTHS,
            slice_lengths=(8, 32),
        )
    except Exception as error:  # noqa: BLE001 - reported with the other failures
        failures.append(f"slices through the kernels: {error}")
    return failures


if __name__ == "__main__":
    patch_for_numpy()
    patch_bf16_dots()
    from blockzoo_gated_delta_net import triton_delta_rule

    if sys.argv[1] == "bf16-intermediates":
        triton_delta_rule.INTERMEDIATE_DTYPE = torch.bfloat16
        in_bf16 = [(*case[:6], torch.bfloat16, *case[7:]) for case in FAST_CASES]
        failures = check_cases(in_bf16, BF16_INTERMEDIATES_TOLERANCE)
        # fp32 inputs keep fp32 intermediates whatever INTERMEDIATE_DTYPE says: fp32's tolerance.
        failures += check_cases([case for case in FAST_CASES if case[6] == torch.float32])
    else:
        # Kept in fp32, the kernels' arithmetic is checked to fp32's tolerance (bf16 inputs aside).
        triton_delta_rule.INTERMEDIATE_DTYPE = torch.float32
        if sys.argv[1] == "layer":
            failures = check_layer()
        elif sys.argv[1] == "fast":
            # Blocks of 16 key channels: the cases' heads of 24 and 32 take two, the last partly past the head's end.
            triton_delta_rule.KEY_BLOCK = 16
            failures = check_cases(FAST_CASES)
        else:
            failures = check_cases(SLOW_CASES)
    if failures:
        sys.exit("\n".join(failures))
