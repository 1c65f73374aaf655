"""blockzoo_ssm on CUDA: `ssd_scan` through mamba_ssm's Triton kernel against the torch path (run on the CPU in
float64), the adapter finding the Triton-only mamba_ssm, and the time of the first call (autotuning included).
Needs a GPU and mamba_ssm (built with MAMBA_SKIP_CUDA_BUILD=TRUE); skipped without CUDA, fails without mamba_ssm.
See the times with `pytest -s` (they are printed either way).

Tolerances are relative errors ‖value − reference‖ / ‖reference‖: the kernel multiplies fp32 in TF32 (about 1e-3);
bf16 keeps 8 bits of mantissa.
"""

import importlib
import importlib.util
import os
import sys
import time

import pytest
import torch

from blockzoo.layers.base import Batch
from blockzoo_ssm import causal_conv1d, gated_rms_norm, import_mamba_ssm, kernels, mamba_ssm_available, scan, ssd_scan

pytestmark = pytest.mark.gpu

LENGTHS = [37, 1, 300, 128, 90]  # Not multiples of the chunk size, and a one-token document.
CHUNK_SIZE = 64
OUTPUT_TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 3e-2}
GRADIENT_TOLERANCE = {torch.float32: 1e-2, torch.bfloat16: 5e-2}


def _inputs(lengths, *, heads=4, head_size=32, groups=2, state_size=16, dt_range=(0.01, 0.2), seed=0):
    generator, tokens = torch.Generator().manual_seed(seed), sum(lengths)
    return {
        "x": torch.randn(tokens, heads, head_size, generator=generator),
        "dt": torch.rand(tokens, heads, generator=generator) * (dt_range[1] - dt_range[0]) + dt_range[0],
        "A": -(torch.rand(heads, generator=generator) * 7 + 1),
        "B": torch.randn(tokens, groups, state_size, generator=generator),
        "C": torch.randn(tokens, groups, state_size, generator=generator),
    }


def _forward_backward(inputs, lengths, *, device, dtype, scale_input):
    leaves = {
        name: tensor.detach().to(device=device, dtype=torch.float32 if name == "A" else dtype).requires_grad_()
        for name, tensor in inputs.items()
    }
    y = ssd_scan(*leaves.values(), Batch(lengths, device=device), chunk_size=CHUNK_SIZE, scale_input=scale_input)
    weights = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(device)
    (y.float() * weights).sum().backward()
    return y, {name: leaf.grad for name, leaf in leaves.items()}


def _relative_error(value, reference):
    reference = reference.detach().double().cpu()
    return float((value.detach().double().cpu() - reference).norm() / reference.norm())


def test_the_adapter_finds_the_triton_only_mamba_ssm():
    assert mamba_ssm_available()
    import_mamba_ssm()
    interface = importlib.import_module("mamba_ssm.ops.selective_scan_interface")
    if importlib.util.find_spec(kernels.STAND_IN) is None:  # Triton-only build: the stand-in served the import
        assert interface.selective_scan_cuda.__name__ == kernels.STAND_IN and kernels.STAND_IN not in sys.modules


@pytest.mark.parametrize("scale_input", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ssd_scan_kernel_matches_the_torch_path(dtype, scale_input, capsys):
    # Time steps as each use has them: Mamba 2's dt in [dt_min, dt_max]; discrete Mamba 2's softplus(A_log) near 0.7
    # (its input is not scaled: the kernel gets x / dt, whose dt gradient is a difference of two large terms).
    inputs = _inputs(LENGTHS, dt_range=(0.01, 0.2) if scale_input else (0.2, 1.2))
    # The reference starts from the inputs the kernel sees (A stays fp32).
    inputs = {name: tensor if name == "A" else tensor.to(dtype).float() for name, tensor in inputs.items()}
    expected, expected_grads = _forward_backward(
        inputs, LENGTHS, device="cpu", dtype=torch.float64, scale_input=scale_input
    )
    torch.cuda.synchronize()
    start = time.perf_counter()
    y, grads = _forward_backward(inputs, LENGTHS, device="cuda", dtype=dtype, scale_input=scale_input)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    with capsys.disabled():  # the first call of each dtype includes compiling and autotuning the kernels
        print(f"\nssd_scan kernel {dtype} scale_input={scale_input}: forward+backward {seconds:.2f} s")
    assert y.dtype == dtype and y.is_cuda
    assert _relative_error(y, expected) < OUTPUT_TOLERANCE[dtype]
    for name, grad in grads.items():
        assert _relative_error(grad, expected_grads[name]) < GRADIENT_TOLERANCE[dtype], name


def test_autotuning_is_bounded_by_default():
    from triton.runtime.autotuner import Autotuner

    if kernels.autotune_limit() is None:
        pytest.skip("BLOCKZOO_SSD_AUTOTUNE=full keeps every config")
    kernels._chunk_scan_combined()
    for name in kernels.SSD_MODULES:
        module = importlib.import_module(f"mamba_ssm.ops.triton.{name}")
        for kernel in vars(module).values():
            if isinstance(kernel, Autotuner):
                assert len(kernel.configs) <= kernels.autotune_limit(), kernel.base_fn.__name__


# Run in a fresh process with an empty Triton cache: one forward+backward of the SSD scan and the convolution.
_TUNE_ONCE = """
import torch
from blockzoo.layers.base import Batch
from blockzoo_ssm import causal_conv1d, ssd_scan
lengths = [300, 200]
batch = Batch(lengths, device="cuda")
x = torch.randn(500, 4, 32, device="cuda", requires_grad=True)
dt = torch.rand(500, 4, device="cuda", requires_grad=True)
B, C = (torch.randn(500, 1, 16, device="cuda", requires_grad=True) for _ in range(2))
ssd_scan(x, dt, -torch.ones(4, device="cuda"), B, C, batch, chunk_size=64).sum().backward()
xbc = torch.randn(500, 128, device="cuda", requires_grad=True)
causal_conv1d(xbc, torch.randn(128, 4, device="cuda"), None, batch, activation="silu").sum().backward()
torch.cuda.synchronize()
"""


def test_autotuning_results_are_cached_on_disk(tmp_path):
    """The SSD kernels without pre-hooks and the convolution's kernels leave their autotuning results in Triton's
    cache (read by later runs instead of benchmarking), where the installed triton can."""
    import subprocess

    from triton.runtime.autotuner import Autotuner

    if not hasattr(Autotuner, "check_disk_cache"):
        pytest.skip("this triton cannot cache autotuning results")
    environment = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path), "BLOCKZOO_SSD_AUTOTUNE": "small"}
    subprocess.run([sys.executable, "-c", _TUNE_ONCE], env=environment, check=True, timeout=600)
    tuned = sorted({path.name for path in tmp_path.rglob("*.autotune.json")})
    print(f"\nautotuning results cached: {tuned}")
    assert "_conv_forward_kernel.autotune.json" in tuned and "_conv_backward_kernel.autotune.json" in tuned
    assert any(name.startswith("_chunk") or name.startswith("_bmm") for name in tuned), tuned


def test_generation_state_on_cuda_takes_the_torch_path():
    lengths = [5, 9]
    inputs = _inputs(lengths)
    initial = torch.randn(len(lengths), 4, 32, 16, generator=torch.Generator().manual_seed(2))
    states = {device: initial.clone().to(device) for device in ("cpu", "cuda")}
    outputs = {
        device: ssd_scan(
            *(t.to(device) for t in inputs.values()),
            Batch(lengths, device=device, past_lengths=[3, 1]),
            chunk_size=4,
            state=states[device],
        )
        for device in ("cpu", "cuda")
    }
    assert _relative_error(outputs["cuda"], outputs["cpu"]) < 1e-4
    assert _relative_error(states["cuda"], states["cpu"]) < 1e-4


def test_speed_at_a_training_shape(capsys, monkeypatch):
    # 2 documents of 4096 tokens, 32 heads of 64, state 128, chunk 256, bf16: the kernel, then the torch path.
    lengths = [4096, 4096]
    inputs = {
        name: tensor.cuda()
        for name, tensor in _inputs(lengths, heads=32, head_size=64, groups=1, state_size=128).items()
    }
    times = {}
    for path in ("kernel", "torch"):
        if path == "torch":
            monkeypatch.setattr(scan, "mamba_ssm_available", lambda: False)
        for _ in range(3):  # the last of three calls
            torch.cuda.synchronize()
            start = time.perf_counter()
            _forward_backward(inputs, lengths, device="cuda", dtype=torch.bfloat16, scale_input=True)
            torch.cuda.synchronize()
            times[path] = f"{(time.perf_counter() - start) * 1000:.1f} ms"
    with capsys.disabled():
        print(f"\nssd_scan 2x4096 tokens, 32 heads x 64, state 128, bf16, forward+backward: {times}")


def _leaves(tensors, device, dtype):
    return [tensor.detach().to(device=device, dtype=dtype).requires_grad_() for tensor in tensors]


def _compare_on_cuda(function, tensors, dtype, tolerance):
    """`function` on CUDA in `dtype` (the GPU path) against the CPU path in float64: output and every gradient."""
    results = {}
    for device, compute_dtype in (("cpu", torch.float64), ("cuda", dtype)):
        leaves = _leaves(tensors, device, compute_dtype)
        output = function(*leaves, device)
        weights = torch.randn(output.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        (output.double() * weights.to(device)).sum().backward()
        results[device] = (output, [leaf.grad for leaf in leaves])
    assert results["cuda"][0].dtype == dtype
    assert _relative_error(results["cuda"][0], results["cpu"][0]) < tolerance
    for index, (grad, expected) in enumerate(zip(results["cuda"][1], results["cpu"][1])):
        if expected is None:  # an input the function does not use (the gate of an ungated norm)
            assert grad is None
            continue
        assert _relative_error(grad, expected) < tolerance, f"gradient of input {index}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group_size", [64, 256])
@pytest.mark.parametrize("gated", [True, False])
def test_gated_rms_norm_through_the_fused_kernel(dtype, group_size, gated):
    generator = torch.Generator().manual_seed(4)
    x, gate = torch.randn(2, 300, 256, generator=generator)
    weight = 1 + 0.1 * torch.randn(256, generator=generator)

    def norm(x, gate, weight, device):
        return gated_rms_norm(x, gate if gated else None, weight, epsilon=1e-5, group_size=group_size)

    _compare_on_cuda(norm, (x, gate, weight), dtype, {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gated_rms_norm_before_the_gate_through_the_fused_kernel(dtype):
    generator = torch.Generator().manual_seed(4)
    x, gate = torch.randn(2, 300, 256, generator=generator)
    weight = 1 + 0.1 * torch.randn(256, generator=generator)

    def norm(x, gate, weight, device):
        return gated_rms_norm(x, gate, weight, epsilon=1e-5, group_size=64, norm_before_gate=True)

    _compare_on_cuda(norm, (x, gate, weight), dtype, {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_causal_conv1d_on_cuda(dtype):
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(sum(LENGTHS), 96, generator=generator)
    weight, bias = torch.randn(96, 4, generator=generator), torch.randn(96, generator=generator)

    def conv(x, weight, bias, device):
        return causal_conv1d(x, weight, bias, Batch(LENGTHS, device=device), activation="silu")

    _compare_on_cuda(conv, (x, weight, bias), dtype, {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype])


@pytest.mark.parametrize("scale_input", [True, False])
def test_ssd_scan_time_step_on_cuda(scale_input):
    """dt_bias, softplus and dt_limit computed inside the kernel (scale_input) or before it, against the torch path:
    the output and the gradients of the raw dt and of dt_bias (some steps clamped, whose gradient is 0)."""
    inputs = _inputs(LENGTHS)
    generator = torch.Generator().manual_seed(10)
    inputs["dt"] = torch.randn(sum(LENGTHS), 4, generator=generator) * 2 - 3  # softplus of it near 0.01 .. 0.5
    dt_bias = torch.randn(4, generator=generator) * 0.5

    def scan_with_time_step(x, dt, A, B, C, dt_bias, device):
        batch = Batch(LENGTHS, device=device)
        return ssd_scan(
            x, dt, A, B, C, batch, chunk_size=CHUNK_SIZE, scale_input=scale_input, dt_bias=dt_bias, dt_softplus=True,
            dt_limit=(0.02, 0.3),
        )  # fmt: skip

    _compare_on_cuda(scan_with_time_step, (*inputs.values(), dt_bias), torch.float32, 1e-2)


@pytest.mark.parametrize("scale_input", [True, False])
def test_ssd_scan_skip_on_cuda(scale_input):
    inputs = _inputs(LENGTHS, dt_range=(0.01, 0.2) if scale_input else (0.2, 1.2))
    skip = torch.randn(4, 32, generator=torch.Generator().manual_seed(8))

    def scan_with_skip(x, dt, A, B, C, D, device):
        return ssd_scan(
            x, dt, A, B, C, Batch(LENGTHS, device=device), chunk_size=CHUNK_SIZE, D=D, scale_input=scale_input
        )

    _compare_on_cuda(scan_with_skip, (*inputs.values(), skip), torch.float32, 1e-2)


@pytest.mark.parametrize("scale_input", [True, False])
def test_ssd_scan_kernel_takes_the_initial_state_and_returns_the_final_one(scale_input):
    """mamba_ssm's `initial_states` / `return_final_states` (a slice of a longer sequence) against the torch path in
    float64: the output, the final state, and the gradients of every input and of the initial state."""
    inputs = _inputs(LENGTHS, dt_range=(0.01, 0.2) if scale_input else (0.2, 1.2))
    inputs["initial"] = torch.randn(4, 32, 16, generator=torch.Generator().manual_seed(3))
    weights = torch.Generator().manual_seed(1)
    output_weights = torch.randn(sum(LENGTHS), 4, 32, generator=weights)
    final_weights = torch.randn(4, 32, 16, generator=weights)

    def run(device, dtype):
        leaves = {
            name: tensor.to(
                device=device, dtype=dtype if name in ("x", "B", "C") else torch.promote_types(dtype, torch.float32)
            ).requires_grad_()
            for name, tensor in inputs.items()
        }
        initial = leaves.pop("initial")
        y, final = ssd_scan(
            *leaves.values(), Batch(LENGTHS, device=device), chunk_size=CHUNK_SIZE, scale_input=scale_input,
            initial_state=initial, return_final_state=True,
        )  # fmt: skip
        loss = (y.double() * output_weights.to(device)).sum() + (final.double() * final_weights.to(device)).sum()
        loss.backward()
        return y, final, {**{name: leaf.grad for name, leaf in leaves.items()}, "initial": initial.grad}

    expected_y, expected_final, expected_grads = run("cpu", torch.float64)
    y, final, grads = run("cuda", torch.float32)
    assert final.dtype == torch.float32 and final.shape == (4, 32, 16)
    assert _relative_error(y, expected_y) < OUTPUT_TOLERANCE[torch.float32]
    assert _relative_error(final, expected_final) < OUTPUT_TOLERANCE[torch.float32]
    for name, grad in grads.items():
        assert _relative_error(grad, expected_grads[name]) < GRADIENT_TOLERANCE[torch.float32], name


def test_slice_functions_on_cuda_match_the_cpu(capsys):
    """The slice functions (micro-sequences: the kernels with initial states and final states) over consecutive
    slices on CUDA against the same on the CPU in float64."""
    from blockzoo.layers.base import slice_batch
    from blockzoo_ssm import causal_conv1d_slice, selective_scan_slice, ssd_scan_slice

    lengths, boundaries = [37, 1, 300, 128, 90], [37, 50, 338, 380, 500]
    cuts = [0, *boundaries]
    generator = torch.Generator().manual_seed(0)
    tokens = sum(lengths)
    ssd = _inputs(lengths)
    selective = {
        "u": torch.randn(tokens, 32, generator=generator),
        "delta": torch.rand(tokens, 32, generator=generator) * 0.2 + 0.01,
        "A": -torch.rand(32, 8, generator=generator) - 0.5,
        "B": torch.randn(tokens, 2, 8, generator=generator),
        "C": torch.randn(tokens, 2, 8, generator=generator),
    }
    conv = {"x": torch.randn(tokens, 64, generator=generator), "weight": torch.randn(64, 4, generator=generator)}

    def over_slices(function, per_token, constants, device, dtype):
        per_token = [t.to(device=device, dtype=dtype) for t in per_token]
        constants = [t.to(device=device, dtype=torch.promote_types(dtype, torch.float32)) for t in constants]
        outputs, carry = [], None
        for start, stop in zip(cuts, [*cuts[1:], tokens]):
            batch = slice_batch(lengths, start, stop, device=device)
            y, carry = function(*(t[start:stop] for t in per_token), *constants, batch, carry)
            outputs.append(y)
        return torch.cat(outputs), carry

    functions = {
        "ssd_scan_slice": (
            lambda x, dt, B, C, A, batch, previous: ssd_scan_slice(x, dt, A, B, C, batch, previous, chunk_size=64),
            [ssd["x"], ssd["dt"], ssd["B"], ssd["C"]],
            [ssd["A"]],
        ),
        "selective_scan_slice": (
            lambda u, delta, B, C, A, batch, previous: selective_scan_slice(u, delta, A, B, C, batch, previous),
            [selective[name] for name in ("u", "delta", "B", "C")],
            [selective["A"]],
        ),
        "causal_conv1d_slice": (
            lambda x, weight, batch, previous: causal_conv1d_slice(x, weight, None, batch, previous, activation="silu"),
            [conv["x"]],
            [conv["weight"]],
        ),
    }
    for name, (function, per_token, constants) in functions.items():
        expected, expected_carry = over_slices(function, per_token, constants, "cpu", torch.float64)
        y, carry = over_slices(function, per_token, constants, "cuda", torch.float32)
        assert _relative_error(y, expected) < OUTPUT_TOLERANCE[torch.float32], name
        assert _relative_error(carry, expected_carry) < OUTPUT_TOLERANCE[torch.float32], name
