"""The Triton selective scan (`blockzoo_ssm.triton_selective_scan`) against a float64 step-by-step loop written
here: the output and the gradients of u, delta, A, B and C, over packed documents of odd lengths; with initial
states (each document's) and final states, their values and gradients too (a slice of a longer sequence).

Where triton is importable, the kernels run under Triton's interpreter on CPU tensors, in a subprocess (the
interpreter is chosen when the kernels are defined, from TRITON_INTERPRET; a GPU run in this process must not
see it). The `gpu` tests run the compiled kernels on CUDA, with a long document and a timing against a plain
torch loop. Errors are relative: ‖value − reference‖ / ‖reference‖.
"""

import sys
import time

import pytest
import torch

from blockzoo_testing.triton_interpreter import patch_for_numpy, run_interpreter_cases

# (lengths, channels, groups, state_size, dtype). Lengths cross the checkpoint interval (32) once and twice, one is
# empty; channel blocks hold all channels, one group of two, or a third of a group (channels 6, groups 2: blocks
# of one channel); the state size 5 is no power of two. Small: the interpreter takes milliseconds per token.
INTERPRETER_CASES = [
    ((1, 5, 37), 16, 1, 4, torch.float32),
    ((70, 3), 4, 1, 5, torch.float32),
    ((4, 0, 3, 1), 6, 2, 4, torch.float32),
    ((5, 1, 9), 16, 2, 4, torch.bfloat16),
]
# With initial states and final states (in the loss): documents within one checkpoint interval, across two, and
# an empty one (its final state is its initial state).
STATE_CASES = [
    ((5, 1, 37), 16, 1, 4, torch.float32),
    ((4, 0, 3), 6, 2, 4, torch.float32),
]
# Interpreter and GPU, fp32: the kernels accumulate in fp32 (the GPU's exp is approximate).
FP32_TOLERANCE = 1e-4
# bf16 inputs and outputs: the reference sees the same rounded inputs; y and the gradients are rounded to bf16.
BF16_TOLERANCE = 1e-2


def reference_selective_scan(u, delta, A, B, C, lengths, initial_states=None):
    """y [tokens, channels] by the recurrence, one token at a time, in the inputs' dtype; with `initial_states`
    [documents, channels, state], (y, the final states)."""
    channels, groups = u.shape[1], B.shape[1]
    B = B.repeat_interleave(channels // groups, dim=1)  # [tokens, channels, state]: channel d reads group d // (D/G)
    C = C.repeat_interleave(channels // groups, dim=1)
    # Per-token views (unbind: one gradient buffer in the backward, not one per indexed token).
    u, delta, B, C = (tensor.unbind(0) for tensor in (u, delta, B, C))
    outputs, finals, start = [], [], 0
    for document, length in enumerate(lengths):
        state = A.new_zeros(A.shape) if initial_states is None else initial_states[document]
        for t in range(start, start + length):
            state = torch.exp(delta[t][:, None] * A) * state + (delta[t] * u[t])[:, None] * B[t]
            outputs.append((state * C[t]).sum(-1))
        finals.append(state)
        start += length
    return torch.stack(outputs) if initial_states is None else (torch.stack(outputs), torch.stack(finals))


def make_inputs(lengths, channels, groups, state_size, dtype, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)

    def normal(*shape):
        return torch.randn(*shape, generator=generator)

    inputs = {
        "u": normal(tokens, channels),
        "delta": torch.nn.functional.softplus(normal(tokens, channels) - 1.0),
        "A": -torch.exp(normal(channels, state_size) * 0.5),
        "B": normal(tokens, groups, state_size),
        "C": normal(tokens, groups, state_size),
    }
    inputs = {name: value.to(torch.float32 if name == "A" else dtype) for name, value in inputs.items()}
    output_weights = normal(tokens, channels)
    return {name: value.to(device) for name, value in inputs.items()}, output_weights.to(device)


def relative_errors(lengths, channels, groups, state_size, dtype, device, states=False):
    """{"y": error, "u": error of du, ...} of the kernel against the float64 loop on the same (rounded) inputs,
    both on `device`; with `states`, from random initial states, the final states in the loss."""
    from blockzoo_ssm.triton_selective_scan import selective_scan_triton

    inputs, output_weights = make_inputs(lengths, channels, groups, state_size, dtype, device)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    final_weights = None
    if states:
        generator = torch.Generator().manual_seed(1)
        inputs["initial_states"] = torch.randn(len(lengths), channels, state_size, generator=generator).to(device)
        final_weights = torch.randn(len(lengths), channels, state_size, generator=generator).to(device)

    def loss(y, finals):
        total = (y.double() * output_weights.double()).sum()
        return total if finals is None else total + (finals.double() * final_weights.double()).sum()

    leaves = {name: value.clone().requires_grad_() for name, value in inputs.items()}
    y = selective_scan_triton(**leaves, cu_seqlens=cu_seqlens, return_final_states=states)
    y, finals = y if states else (y, None)
    assert y.dtype == dtype and y.shape == inputs["u"].shape
    loss(y, finals).backward()
    with torch.no_grad():  # The forward that stores no checkpoints.
        y_without_gradients = selective_scan_triton(**inputs, cu_seqlens=cu_seqlens)

    reference_leaves = {name: value.detach().double().requires_grad_() for name, value in inputs.items()}
    reference = reference_selective_scan(**reference_leaves, lengths=lengths)
    reference, reference_finals = reference if states else (reference, None)
    loss(reference, reference_finals).backward()

    def error(value, expected):
        return float((value.detach().double() - expected.detach()).norm() / expected.detach().norm())

    errors = {"y": error(y, reference), "y without gradients": error(y_without_gradients, reference)}
    if states:
        errors["final states"] = error(finals, reference_finals)
    for name, leaf in leaves.items():
        assert leaf.grad.dtype == leaf.dtype, name
        errors[name] = error(leaf.grad, reference_leaves[name].grad)
    return errors


def check_cases(cases, device, states=False) -> list[str]:
    """One line per case and quantity beyond its tolerance (nothing when all pass)."""
    failures = []
    for lengths, channels, groups, state_size, dtype in cases:
        tolerance = BF16_TOLERANCE if dtype == torch.bfloat16 else FP32_TOLERANCE
        errors = relative_errors(lengths, channels, groups, state_size, dtype, device, states=states)
        documents = f"lengths={lengths}" if len(lengths) < 10 else f"{len(lengths)} documents"
        case = f"{documents} channels={channels} groups={groups} state={state_size} {dtype}"
        case += " with initial and final states" if states else ""
        print(f"{case}: max relative error {max(errors.values()):.2e}", flush=True)
        failures += [
            f"{case}: {name} relative error {value:.2e} > {tolerance}"
            for name, value in errors.items()
            if not value <= tolerance  # NaN fails too
        ]
    return failures


def _run_under_interpreter() -> None:
    """Entry point of the interpreter subprocess (TRITON_INTERPRET=1 in its environment)."""
    patch_for_numpy()
    failures = check_cases(INTERPRETER_CASES, torch.device("cpu"))
    failures += check_cases(STATE_CASES, torch.device("cpu"), states=True)
    if failures:
        sys.exit("\n".join(failures))


def test_interpreter_matches_the_float64_loop():
    run_interpreter_cases(__file__, "--interpreter")


def test_bad_inputs_are_named():
    pytest.importorskip("triton")
    from blockzoo_ssm.triton_selective_scan import selective_scan_triton

    inputs, _ = make_inputs((3, 2), 6, 2, 4, torch.float32, "cpu")
    cu_seqlens = torch.tensor([0, 3, 5], dtype=torch.int32)
    bad = {
        "delta has shape": {"delta": inputs["delta"][:, :4]},
        "multiple of groups": {"B": inputs["B"][:, :1].expand(5, 4, 4), "C": inputs["C"][:, :1].expand(5, 4, 4)},
        "A must be \\[6, 4\\]": {"A": inputs["A"][:, :3]},
        "u must be \\[tokens, channels\\]": {"u": inputs["u"][None]},
        "C has shape": {"C": inputs["C"][:4]},
        "cu_seqlens must be": {"cu_seqlens": cu_seqlens.float()},
    }
    for message, replaced in bad.items():
        arguments = {**inputs, "cu_seqlens": cu_seqlens, **replaced}
        with pytest.raises(ValueError, match=message):
            selective_scan_triton(**arguments)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_matches_the_float64_loop(dtype):
    cases = [(lengths, channels, groups, state, dtype) for lengths, channels, groups, state, _ in INTERPRETER_CASES]
    cases.append(((3000, 7, 1), 16, 2, 16, dtype))  # a long document: about a hundred checkpoints
    # Many short documents over 16 channel blocks: each backward program walks several documents.
    cases.append((tuple(5 * i % 8 + 1 for i in range(300)), 512, 1, 16, dtype))
    failures = check_cases(cases, torch.device("cuda"))
    state_cases = [(lengths, channels, groups, state, dtype) for lengths, channels, groups, state, _ in STATE_CASES]
    state_cases.append(((3000, 7, 1), 16, 2, 16, dtype))
    failures += check_cases(state_cases, torch.device("cuda"), states=True)
    assert not failures, "\n".join(failures)


def torch_loop_selective_scan(u, delta, A, B, C, documents):
    """The naive GPU baseline: documents of equal length, one step of torch ops per token, in fp32."""
    tokens, channels = u.shape
    length = tokens // documents
    u, delta = u.view(documents, length, channels), delta.view(documents, length, channels)
    B = B.view(documents, length, -1, B.shape[-1]).repeat_interleave(channels // B.shape[1], dim=2)
    C = C.view(documents, length, -1, C.shape[-1]).repeat_interleave(channels // C.shape[1], dim=2)
    state = u.new_zeros(documents, *A.shape)
    outputs = []
    for t in range(length):
        state = torch.exp(delta[:, t, :, None] * A) * state + (delta[:, t] * u[:, t])[..., None] * B[:, t]
        outputs.append((state * C[:, t]).sum(-1))
    return torch.stack(outputs, 1).reshape(tokens, channels)


# The benchmark shape: documents × length tokens, channels, state size (Mamba 1 at 768 hidden, expand 2).
SPEED_SHAPE = (8, 2048, 1536, 16)


def _speed_inputs():
    documents, length, channels, state_size = SPEED_SHAPE
    inputs, output_weights = make_inputs((length,) * documents, channels, 1, state_size, torch.float32, "cuda")
    cu_seqlens = torch.arange(0, documents + 1, dtype=torch.int32, device="cuda") * length
    return inputs, output_weights, cu_seqlens


def _timed(function, repeats):
    """(the last result, seconds per call)."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        result = function()
    torch.cuda.synchronize()
    return result, (time.perf_counter() - started) / repeats


def _forward_backward(scan, inputs, output_weights, dtype):
    """(y, {name: gradient}) of sum(y * output_weights), inputs other than A cast to dtype."""
    dtypes = {name: torch.float32 if name == "A" else dtype for name in inputs}
    leaves = {name: value.to(dtypes[name], copy=True).requires_grad_() for name, value in inputs.items()}
    y = scan(**leaves)
    (y.float() * output_weights).sum().backward()
    return y.detach(), {name: leaf.grad for name, leaf in leaves.items()}


def _assert_close(result, expected, tolerance, what):
    (y, grads), (expected_y, expected_grads) = result, expected
    for name, value, reference in [("y", y, expected_y), *[(n, grads[n], expected_grads[n]) for n in grads]]:
        error = float((value.float() - reference.float()).norm() / reference.float().norm())
        assert error < tolerance, f"{name}: relative error {error:.2e} against {what}"


@pytest.mark.gpu
def test_cuda_speed_against_a_torch_loop():
    """Prints forward and forward+backward times at SPEED_SHAPE (fp32 and bf16 inputs) against a plain torch loop
    on the GPU, and checks that both agree there."""
    from blockzoo_ssm.triton_selective_scan import selective_scan_triton

    documents, length, channels, state_size = SPEED_SHAPE
    inputs, output_weights, cu_seqlens = _speed_inputs()

    def triton_scan(**leaves):
        return selective_scan_triton(**leaves, cu_seqlens=cu_seqlens)

    def loop_scan(**leaves):
        return torch_loop_selective_scan(**leaves, documents=documents)

    _, first_call = _timed(lambda: _forward_backward(triton_scan, inputs, output_weights, torch.float32), 1)
    result, kernel_time = _timed(lambda: _forward_backward(triton_scan, inputs, output_weights, torch.float32), 5)
    with torch.no_grad():
        _, forward_time = _timed(lambda: triton_scan(**inputs), 5)
    _, bf16_time = _timed(lambda: _forward_backward(triton_scan, inputs, output_weights, torch.bfloat16), 5)
    expected, loop_time = _timed(lambda: _forward_backward(loop_scan, inputs, output_weights, torch.float32), 1)
    print(
        f"\nselective scan, {documents}×{length} tokens, {channels} channels, state {state_size}: "
        f"first call (compiles) {first_call * 1e3:.0f} ms; triton forward {forward_time * 1e3:.2f} ms, "
        f"forward+backward {kernel_time * 1e3:.2f} ms (bf16 inputs {bf16_time * 1e3:.2f} ms); "
        f"torch loop forward+backward {loop_time * 1e3:.0f} ms ({loop_time / kernel_time:.0f}× slower)"
    )
    _assert_close(result, expected, 1e-3, "the torch loop")


@pytest.mark.gpu
def test_cuda_tile_shapes(monkeypatch):
    """Prints forward+backward times at SPEED_SHAPE for a few tile shapes (to choose the defaults) and checks
    that they agree."""
    from blockzoo_ssm import triton_selective_scan as module

    documents, _, channels, state_size = SPEED_SHAPE
    inputs, output_weights, cu_seqlens = _speed_inputs()

    def triton_scan(**leaves):
        return module.selective_scan_triton(**leaves, cu_seqlens=cu_seqlens)

    expected = None
    for tile_elements, elements_per_thread in [(128, 4), (256, 4), (256, 8), (512, 4), (512, 8), (512, 16)]:
        monkeypatch.setattr(module, "_TILE_ELEMENTS", tile_elements)
        monkeypatch.setattr(module, "_ELEMENTS_PER_THREAD", elements_per_thread)
        block_d, _, warps = module._block_sizes(documents, channels, channels, state_size, torch.device("cuda"))
        _forward_backward(triton_scan, inputs, output_weights, torch.bfloat16)  # compiles
        result, seconds = _timed(lambda: _forward_backward(triton_scan, inputs, output_weights, torch.bfloat16), 5)
        with torch.no_grad():
            _, forward_seconds = _timed(lambda: triton_scan(**inputs), 5)
        print(
            f"\nBLOCK_D {block_d}, {warps} warps: bf16 forward+backward {seconds * 1e3:.2f} ms, "
            f"fp32 forward {forward_seconds * 1e3:.2f} ms"
        )
        if expected is None:
            expected = result
        _assert_close(result, expected, 1e-2, "the first tile shape")


if __name__ == "__main__" and sys.argv[1:] == ["--interpreter"]:
    _run_under_interpreter()
