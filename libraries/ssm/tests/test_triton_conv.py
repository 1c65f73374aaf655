"""The Triton causal convolution (`blockzoo_ssm.triton_conv`) against a float64 tap-by-tap loop written here: the
output and the gradients of x, weight and bias, over packed documents of odd lengths, one-token documents, kernel
sizes 1 to 4, with and without bias and silu, x read in place from a wider tensor (in_proj's output); with the inputs
before the batch (a slice of a longer sequence), their gradient too.

Where triton is importable, the kernels run under Triton's interpreter on CPU tensors, in a subprocess (the
interpreter is chosen when the kernels are defined, from TRITON_INTERPRET; a GPU run in this process must not see
it). The `gpu` tests run the compiled kernels on CUDA: values and gradients (long and many documents), the dispatch
of `causal_conv1d`, and a timing against the cuDNN path and `torch.compile` of the same computation in torch ops
(`shifted_causal_conv1d`). Errors are relative: ‖value − reference‖ / ‖reference‖.
"""

import sys
import time

import pytest
import torch
import torch.nn.functional as F

from blockzoo.layers.base import Batch
from blockzoo_testing.triton_interpreter import patch_for_numpy, run_interpreter_cases

# (lengths, channels, kernel_size, bias, activation, dtype). The interpreter's tiles are 8 tokens × 8 channels and
# each backward program walks 16 tokens, so these cross tiles, programs and documents; small: the interpreter takes
# long.
INTERPRETER_CASES = [
    ((5, 1, 9, 3), 16, 4, True, "silu", torch.float32),
    ((1, 1, 1, 2), 8, 4, False, "silu", torch.float32),
    ((11, 6), 24, 3, True, None, torch.float32),
    ((3, 14), 8, 2, False, None, torch.float32),
    ((7, 2), 8, 1, True, "silu", torch.float32),
    ((6, 1, 10), 16, 4, True, "silu", torch.bfloat16),
]
FP32_TOLERANCE = 1e-5
# bf16 inputs and outputs: the reference sees the same rounded inputs; y and dx are rounded to bf16.
BF16_TOLERANCE = 1e-2
# x is a slice of a [tokens, WIDER] tensor starting at column OFFSET, as x‖B‖C is of in_proj's output.
OFFSET, EXTRA_COLUMNS = 8, 24


def reference_conv(x, weight, bias, lengths, activation):
    """y [tokens, channels] one token and one tap at a time, taps before the document's first token reading
    nothing, in the inputs' dtype (float64 here)."""
    kernel_size = weight.shape[1]
    rows, taps = x.unbind(0), weight.unbind(1)  # one gradient buffer in the backward, not one per indexed row
    outputs, start = [], 0
    for length in lengths:
        for t in range(start, start + length):
            total = torch.zeros_like(rows[t]) if bias is None else bias
            for j in range(min(kernel_size, t - start + 1)):
                total = total + taps[kernel_size - 1 - j] * rows[t - j]
            outputs.append(F.silu(total) if activation == "silu" else total)
        start += length
    return torch.stack(outputs)


def relative_errors(lengths, channels, kernel_size, with_bias, activation, dtype, device, seed=0):
    """{"y": error, "x": error of dx, ...} of the kernel against the float64 loop on the same (rounded) inputs."""
    from blockzoo_ssm.scan import positions_in_batch
    from blockzoo_ssm.triton_conv import causal_conv1d_triton

    generator = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    wide = torch.randn(tokens, OFFSET + channels + EXTRA_COLUMNS, generator=generator).to(dtype)
    weight = torch.randn(channels, kernel_size, generator=generator) * 0.5  # fp32, as the master weights are
    bias = torch.randn(channels, generator=generator) if with_bias else None
    output_weights = torch.randn(tokens, channels, generator=generator, dtype=torch.float64)
    positions = positions_in_batch(Batch(lengths)).int()

    leaves = {"x": wide.to(device, copy=True).requires_grad_(), "weight": weight.to(device, copy=True).requires_grad_()}
    if with_bias:
        leaves["bias"] = bias.to(device, copy=True).requires_grad_()
    x = leaves["x"][:, OFFSET : OFFSET + channels]
    y = causal_conv1d_triton(x, leaves["weight"], leaves.get("bias"), positions.to(device), activation=activation)
    assert y.dtype == dtype and y.shape == (tokens, channels) and y.is_contiguous()
    (y.double() * output_weights.to(device)).sum().backward()
    assert not leaves["x"].grad[:, :OFFSET].any() and not leaves["x"].grad[:, OFFSET + channels :].any()

    reference_leaves = {
        "x": wide[:, OFFSET : OFFSET + channels].double().requires_grad_(),
        "weight": weight.double().requires_grad_(),
    }
    if with_bias:
        reference_leaves["bias"] = bias.double().requires_grad_()
    reference = reference_conv(
        reference_leaves["x"], reference_leaves["weight"], reference_leaves.get("bias"), lengths, activation
    )
    (reference * output_weights).sum().backward()

    def error(value, expected):
        return float((value.detach().cpu().double() - expected.detach()).norm() / expected.detach().norm())

    grads = {name: leaf.grad for name, leaf in leaves.items()}
    grads["x"] = grads["x"][:, OFFSET : OFFSET + channels]
    errors = {"y": error(y, reference)}
    for name, grad in grads.items():
        assert grad.dtype == leaves[name].dtype, name
        errors[name] = error(grad, reference_leaves[name].grad)
    return errors


# The Triton path with the inputs before the batch (a slice of a longer sequence): (lengths, channels, kernel_size).
# The first document longer and shorter than the kernel_size - 1 inputs before it.
INITIAL_INPUT_CASES = [((5, 1, 9), 16, 4), ((2, 6), 8, 4)]


def initial_input_errors(lengths, channels, kernel_size, device, seed=0):
    """{"y": error, "initial": error of its gradient, ...} of `triton_causal_conv1d` with `initial` against the
    float64 loop over the batch with the initial inputs put in front of its first document (their outputs left
    out)."""
    from blockzoo_ssm.conv import triton_causal_conv1d

    generator = torch.Generator().manual_seed(seed)
    stored = kernel_size - 1
    inputs = {
        "x": torch.randn(sum(lengths), channels, generator=generator),
        "weight": torch.randn(channels, kernel_size, generator=generator) * 0.5,
        "bias": torch.randn(channels, generator=generator),
        "initial": torch.randn(stored, channels, generator=generator),
    }
    output_weights = torch.randn(sum(lengths), channels, generator=generator, dtype=torch.float64)
    leaves = {name: value.to(device, copy=True).requires_grad_() for name, value in inputs.items()}
    y = triton_causal_conv1d(
        leaves["x"],
        leaves["weight"],
        leaves["bias"],
        Batch(lengths, device=device),
        activation="silu",
        initial=leaves["initial"],
    )
    (y.double() * output_weights.to(device)).sum().backward()

    reference_leaves = {name: value.double().requires_grad_() for name, value in inputs.items()}
    extended = torch.cat([reference_leaves["initial"], reference_leaves["x"]])
    extended_lengths = [lengths[0] + stored, *lengths[1:]]
    weight, bias = reference_leaves["weight"], reference_leaves["bias"]
    reference = reference_conv(extended, weight, bias, extended_lengths, "silu")[stored:]
    (reference * output_weights).sum().backward()

    def error(value, expected):
        return float((value.detach().cpu().double() - expected.detach()).norm() / expected.detach().norm())

    errors = {"y": error(y, reference)}
    errors.update({name: error(leaf.grad, reference_leaves[name].grad) for name, leaf in leaves.items()})
    return errors


def check_cases(cases, device) -> list[str]:
    """One line per case and quantity beyond its tolerance (nothing when all pass)."""
    failures = []
    for lengths, channels, kernel_size, with_bias, activation, dtype in cases:
        tolerance = BF16_TOLERANCE if dtype == torch.bfloat16 else FP32_TOLERANCE
        errors = relative_errors(lengths, channels, kernel_size, with_bias, activation, dtype, device)
        documents = f"lengths={lengths}" if len(lengths) < 10 else f"{len(lengths)} documents"
        case = f"{documents} channels={channels} kernel={kernel_size} bias={with_bias} {activation} {dtype}"
        print(f"{case}: max relative error {max(errors.values()):.2e}", flush=True)
        failures += [
            f"{case}: {name} relative error {value:.2e} > {tolerance}"
            for name, value in errors.items()
            if not value <= tolerance  # NaN fails too
        ]
    return failures


def check_initial_input_cases(device) -> list[str]:
    failures = []
    for lengths, channels, kernel_size in INITIAL_INPUT_CASES:
        errors = initial_input_errors(lengths, channels, kernel_size, device)
        case = f"lengths={lengths} channels={channels} kernel={kernel_size} with the inputs before the batch"
        print(f"{case}: max relative error {max(errors.values()):.2e}", flush=True)
        failures += [
            f"{case}: {name} relative error {value:.2e} > {FP32_TOLERANCE}"
            for name, value in errors.items()
            if not value <= FP32_TOLERANCE
        ]
    return failures


def _run_under_interpreter() -> None:
    """Entry point of the interpreter subprocess (TRITON_INTERPRET=1 in its environment)."""
    patch_for_numpy()
    failures = check_cases(INTERPRETER_CASES, torch.device("cpu"))
    failures += check_initial_input_cases(torch.device("cpu"))
    if failures:
        sys.exit("\n".join(failures))


def test_interpreter_matches_the_float64_loop():
    run_interpreter_cases(__file__, "--interpreter")


def test_the_shifted_torch_formulation_matches_the_float64_loop():
    """`shifted_causal_conv1d` (what torch.compile is measured on against the kernels) computes the same, in fp32."""
    from blockzoo_ssm.conv import shifted_causal_conv1d
    from blockzoo_ssm.scan import positions_in_batch

    lengths = [5, 1, 9, 3]
    generator = torch.Generator().manual_seed(1)
    for kernel_size, activation in [(4, "silu"), (2, None)]:
        tensors = [torch.randn(18, 8, generator=generator), torch.randn(8, kernel_size, generator=generator)]
        tensors.append(torch.randn(8, generator=generator))
        leaves = [tensor.double().requires_grad_() for tensor in tensors]
        expected = reference_conv(*leaves, lengths, activation)
        expected.sum().backward()
        reference_grads = [leaf.grad for leaf in leaves]
        for leaf in leaves:
            leaf.grad = None
        y = shifted_causal_conv1d(*leaves, positions_in_batch(Batch(lengths)), activation=activation)
        y.sum().backward()
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
        for leaf, reference_grad in zip(leaves, reference_grads):
            torch.testing.assert_close(leaf.grad, reference_grad, rtol=1e-5, atol=1e-5)


def test_the_dispatch_rules():
    from blockzoo_ssm import conv

    x, weight = torch.zeros(4, 16), torch.zeros(16, 4)
    assert not conv.uses_triton_kernel(x, weight, None)  # CPU tensors: the torch path
    meta = {"device": "meta"}
    cases = {
        "cuda": (torch.zeros(4, 16, **meta), torch.zeros(16, 4), None),
        "channels not a multiple of 8": (torch.zeros(4, 12, **meta), torch.zeros(12, 4), None),
        "9 taps": (torch.zeros(4, 16, **meta), torch.zeros(16, 9), None),
        "float64": (torch.zeros(4, 16, dtype=torch.float64, **meta), torch.zeros(16, 4), None),
        "a generation state": (torch.zeros(4, 16, **meta), torch.zeros(16, 4), torch.zeros(1, 16, 3)),
    }

    class FakeCuda(torch.Tensor):  # a meta tensor that says it is on CUDA: the rules, not a kernel, are tested
        @property
        def is_cuda(self):
            return True

    taken = {
        name: conv.uses_triton_kernel(x.as_subclass(FakeCuda), weight, state)
        for name, (x, weight, state) in cases.items()
    }
    triton_installed = conv._triton_installed()
    assert taken == {name: name == "cuda" and triton_installed for name in cases}


# ---------------------------------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_matches_the_float64_loop(dtype):
    cases = [(*case[:-1], dtype) for case in INTERPRETER_CASES]
    cases.append(((3000, 7, 1), 64, 4, True, "silu", dtype))  # a long document over many backward programs
    cases.append((tuple(5 * i % 8 + 1 for i in range(300)), 32, 4, True, "silu", dtype))  # many short documents
    cases.append(((1,) * 40, 16, 4, False, "silu", dtype))  # one-token documents only
    cases.append(((513, 250), 2304, 4, True, "silu", dtype))  # Mamba 2's x‖B‖C width at hidden 1024
    cases.append(((100, 37), 40, 3, False, None, dtype))  # channels a multiple of 8, not of the channel tile
    failures = check_cases(cases, torch.device("cuda"))
    if dtype == torch.float32:
        failures += check_initial_input_cases(torch.device("cuda"))
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_causal_conv1d_takes_the_kernel_on_cuda_and_equals_the_cudnn_path(dtype, monkeypatch):
    from blockzoo_ssm import conv

    lengths = [37, 1, 300, 128, 90]
    x, weight, bias = torch.randn(sum(lengths), 96 + 40).cuda(), torch.randn(96, 4).cuda(), torch.randn(96).cuda()
    batch = Batch(lengths, device="cuda")
    assert conv.uses_triton_kernel(x[:, 40:].to(dtype), weight, None)

    def run():
        leaves = [t.detach().clone().requires_grad_() for t in (x.to(dtype), weight, bias)]
        y = conv.causal_conv1d(leaves[0][:, 40:], leaves[1], leaves[2], batch, activation="silu")
        y.float().square().sum().backward()
        return [y, *(leaf.grad for leaf in leaves)]

    kernel = run()
    monkeypatch.setattr(conv, "uses_triton_kernel", lambda *args: False)
    cudnn = run()
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for name, value, expected in zip(["y", "x", "weight", "bias"], kernel, cudnn):
        error = float((value.double() - expected.double()).norm() / expected.double().norm())
        assert error < tolerance, f"{name}: relative error {error:.2e} against the cuDNN path"


def _timed(function, repeats):
    """(the last result, seconds per call)."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        result = function()
    torch.cuda.synchronize()
    return result, (time.perf_counter() - started) / repeats


@pytest.mark.gpu
def test_speed_against_cudnn_and_torch_compile(monkeypatch):
    """Prints forward and forward+backward times at the Mamba 2 layer benchmark's shape (8 × 2048 tokens, x‖B‖C of
    2304 channels read from in_proj's 4384-wide bf16 output, kernel 4, silu, fp32 weights): the Triton kernels,
    the cuDNN path (causal_conv1d's torch path on CUDA) and torch.compile of `shifted_causal_conv1d`, and checks
    that all three agree. The project keeps its kernel only where it beats torch.compile."""
    from blockzoo_ssm import conv
    from blockzoo_ssm.scan import positions_in_batch

    lengths, channels, width = [2048] * 8, 2304, 4384
    batch = Batch(lengths, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    projected = torch.randn(sum(lengths), width, device="cuda", generator=generator).bfloat16()
    weight = torch.randn(channels, 4, device="cuda", generator=generator) * 0.5
    bias = torch.randn(channels, device="cuda", generator=generator)
    output_grad = torch.randn(sum(lengths), channels, device="cuda", generator=generator).bfloat16()
    compiled_conv = torch.compile(conv.shifted_causal_conv1d)
    positions = positions_in_batch(batch)

    def compiled(x, weight, bias, batch, *, activation):
        return compiled_conv(x, weight, bias, positions, activation=activation)

    def step(function, backward=True):
        leaves = [t.detach().requires_grad_(backward) for t in (projected, weight, bias)]
        y = function(leaves[0][:, 2048 : 2048 + channels], leaves[1], leaves[2], batch, activation="silu")
        if backward:
            y.backward(output_grad)
            return [y.detach(), *(leaf.grad for leaf in leaves)]
        return [y]

    def cudnn(*args, **kwargs):
        with monkeypatch.context() as patch:
            patch.setattr(conv, "uses_triton_kernel", lambda *a: False)
            return conv.causal_conv1d(*args, **kwargs)

    contenders = {"triton": conv.causal_conv1d, "cudnn": cudnn, "torch.compile": compiled}
    times, results = {}, {}
    for name, function in contenders.items():
        step(function)  # compiles, autotunes
        results[name], backward_time = _timed(lambda function=function: step(function), 10)
        with torch.no_grad():
            _, forward_time = _timed(lambda function=function: step(function, backward=False), 10)
        times[name] = f"forward {forward_time * 1e3:.3f} ms, forward+backward {backward_time * 1e3:.3f} ms"
    print(f"\ncausal conv1d, 8×2048 tokens, {channels} channels, kernel 4, bf16: {times}")
    for name in ("cudnn", "torch.compile"):
        for what, value, expected in zip(["y", "x", "weight", "bias"], results[name], results["triton"]):
            error = float((value.double() - expected.double()).norm() / expected.double().norm())
            assert error < 2e-2, f"{what}: {name} differs from the Triton kernels by {error:.2e}"


if __name__ == "__main__" and sys.argv[1:] == ["--interpreter"]:
    _run_under_interpreter()
