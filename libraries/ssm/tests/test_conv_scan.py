"""`convolved_ssd_scan` on its kernel path (`blockzoo_ssm.conv_scan`: the convolution recomputed in the backward pass)
against the torch path run in float64 on the CPU — the convolution then `ssd_scan` — output and every gradient, over
packed documents not aligned to the chunks, with x‖B‖C and dt read in place from a wider tensor (in_proj's output);
and what its forward pass keeps: besides its inputs, the scan's output and two index vectors, never the
convolution's output.

Where triton and mamba_ssm import, the kernels run under Triton's interpreter on CPU tensors, in a subprocess (as
test_triton_conv.py's), in fp32, with what mamba_ssm's launch code asks of CUDA stood in for (its device context and
SM count) and one autotune config per kernel (the interpreter cannot time them). The `gpu` test runs them on CUDA
(fp32 and bf16) and measures the memory the forward pass leaves held against the two-step path's. Errors are
relative: ‖value − reference‖ / ‖reference‖.
"""

import contextlib
import importlib.util
import sys
import types

import pytest
import torch

from blockzoo.layers.base import Batch
from blockzoo_testing.triton_interpreter import patch_for_numpy, run_interpreter_cases

LENGTHS = [37, 1, 70, 20]  # chunks of 16: documents across chunk boundaries, a one-token document
HEADS, HEAD_SIZE, GROUPS, STATE = 4, 8, 2, 8
CHUNK_SIZE = 16
OFFSET, EXTRA = 8, 16  # x‖B‖C starts OFFSET columns into a wider [tokens, ...] tensor, dt after it
TOLERANCE = {"cpu": 1e-3, "cuda": 2e-2}  # the interpreter's fp32 products; CUDA's TF32


def layout():
    from blockzoo_ssm.conv_scan import ScanLayout

    return ScanLayout((HEADS * HEAD_SIZE, GROUPS * STATE, GROUPS * STATE), HEAD_SIZE, STATE)


def leaves(device, dtype, lengths=LENGTHS, seed=0):
    """The inputs as the mixer has them: `projected` (in_proj's output, holding x‖B‖C and dt), the convolution's
    weight and bias, a_log, D and dt_bias."""
    generator, tokens = torch.Generator().manual_seed(seed), sum(lengths)
    channels = sum(layout().widths)
    tensors = {
        "projected": torch.randn(tokens, OFFSET + channels + HEADS + EXTRA, generator=generator),
        "weight": torch.randn(channels, 4, generator=generator) * 0.5,
        "bias": torch.randn(channels, generator=generator) * 0.1,
        "a_log": torch.rand(HEADS, generator=generator) * 2,
        "D": torch.randn(HEADS, generator=generator),
        "dt_bias": torch.rand(HEADS, generator=generator) - 2,
    }
    return {
        name: tensor.to(device=device, dtype=dtype if name == "projected" else torch.float32).requires_grad_()
        for name, tensor in tensors.items()
    }


def forward(inputs, lengths, *, kernels: bool) -> torch.Tensor:
    """y; `kernels`: through the kernel path, else the convolution then `ssd_scan` (the torch path on the CPU)."""
    from blockzoo_ssm import conv_scan
    from blockzoo_ssm.conv import causal_conv1d
    from blockzoo_ssm.scan import ssd_scan

    projected = inputs["projected"]
    batch = Batch(lengths, device=projected.device)
    channels = sum(layout().widths)
    xbc, dt = projected[:, OFFSET : OFFSET + channels], projected[:, OFFSET + channels : OFFSET + channels + HEADS]
    A = -torch.exp(inputs["a_log"])
    options = {"chunk_size": CHUNK_SIZE, "D": inputs["D"], "dt_bias": inputs["dt_bias"], "dt_softplus": True}
    if kernels:
        return conv_scan.convolved_ssd_scan(xbc, inputs["weight"], inputs["bias"], dt, A, batch, layout(), **options)
    x, b, c = layout().split(causal_conv1d(xbc, inputs["weight"], inputs["bias"], batch, activation="silu"))
    return ssd_scan(x, dt, A, b, c, batch, **options)


def run(inputs, lengths, *, kernels: bool):
    """y and every leaf's gradient (of a fixed random weighting of y)."""
    y = forward(inputs, lengths, kernels=kernels)
    weights = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.device)
    (y.double() * weights.double()).sum().backward()
    return y, {name: leaf.grad for name, leaf in inputs.items()}


def relative_errors(device, dtype) -> dict[str, float]:
    y, grads = run(leaves(device, dtype), LENGTHS, kernels=True)
    expected_y, expected = run(leaves("cpu", torch.float64), LENGTHS, kernels=False)
    errors = {"y": _relative_error(y, expected_y)}
    errors |= {name: _relative_error(grads[name], expected[name]) for name in expected}
    return errors


def new_saved_bytes(device, dtype) -> tuple[int, int, int]:
    """(bytes of the tensors the kernel path's forward keeps that are not views of its inputs, bytes of its output,
    bytes of the convolution's output it must not keep)."""
    inputs = leaves(device, dtype)
    own = {tensor.untyped_storage().data_ptr() for tensor in inputs.values()}
    kept = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in own:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y = forward(inputs, LENGTHS, kernels=True)
    tokens = sum(LENGTHS)
    return sum(kept.values()), y.numel() * y.element_size(), tokens * sum(layout().widths) * y.element_size()


def check(device) -> list[str]:
    failures = []
    # Under the interpreter (numpy, which has no bf16), mamba_ssm's SSD kernels give nonsense in bf16 (its own
    # `mamba_chunk_scan_combined` too): bf16 is checked on CUDA only.
    for dtype in (torch.float32,) if device == "cpu" else (torch.float32, torch.bfloat16):
        errors = relative_errors(device, dtype)
        tolerance = TOLERANCE[device] * (10 if dtype == torch.bfloat16 else 1)
        print(f"{dtype}: {', '.join(f'{name} {value:.2e}' for name, value in errors.items())}", flush=True)
        failures += [
            f"{dtype}: {name} {value:.2e} > {tolerance}" for name, value in errors.items() if value > tolerance
        ]
    kept, output, convolved = new_saved_bytes(device, torch.float32)
    indices = 2 * 4 * sum(LENGTHS)  # the int32 positions and document indices
    print(f"kept beyond the inputs: {kept} bytes (output {output}, indices {indices}; convolution {convolved})")
    if kept > output + indices + 1024:
        failures.append(f"the forward keeps {kept} bytes beyond its inputs: more than its output and indices")
    return failures


def _relative_error(value, reference) -> float:
    reference = reference.detach().double().cpu()
    return float((value.detach().double().cpu() - reference).norm() / reference.norm())


def _stand_in_for_cuda() -> None:
    """What mamba_ssm's launch code asks of CUDA, for CPU tensors under the interpreter: a device context, an SM
    count; and one autotune config per SSD kernel."""
    from blockzoo_ssm.kernels import SSD_MODULES, import_mamba_ssm, restrict_autotuning

    torch.cuda.device = lambda index: contextlib.nullcontext()
    torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(multi_processor_count=4)
    import_mamba_ssm()
    restrict_autotuning([importlib.import_module(f"mamba_ssm.ops.triton.{name}") for name in SSD_MODULES], 1)


def _run_under_interpreter() -> None:
    """Entry point of the interpreter subprocess (TRITON_INTERPRET=1 in its environment)."""
    patch_for_numpy()
    _stand_in_for_cuda()
    from blockzoo_ssm import conv_scan

    conv_scan.uses_kernels = lambda xbc, weight: True  # CPU tensors: the interpreter runs the kernels
    failures = check("cpu")
    if failures:
        sys.exit("\n".join(failures))


def test_interpreter_matches_the_torch_path_and_keeps_no_convolution():
    if importlib.util.find_spec("mamba_ssm") is None:
        pytest.skip("mamba_ssm (Triton-only) is not installed")
    run_interpreter_cases(__file__, "--interpreter")


@pytest.mark.gpu
def test_kernels_on_cuda_match_the_torch_path_and_hold_less_after_the_forward():
    from blockzoo_ssm import conv_scan

    assert conv_scan.uses_kernels(torch.empty(8, 8, device="cuda"), torch.empty(8, 4, device="cuda"))
    assert not check("cuda")
    # At a layer's shape: what the forward pass leaves allocated, against the two-step path's.
    lengths = [4096, 4096]
    held = {}
    for kernels in (True, False):
        inputs = leaves("cuda", torch.bfloat16, lengths)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = forward(inputs, lengths, kernels=kernels)
        torch.cuda.synchronize()
        held[kernels] = torch.cuda.memory_allocated() - before
        del y
    convolved = sum(lengths) * sum(layout().widths) * 2
    print(
        f"\nheld after the forward: kernel path {held[True]} B, two steps {held[False]} B (convolution {convolved} B)"
    )
    assert held[False] - held[True] >= 0.9 * convolved


if __name__ == "__main__" and "--interpreter" in sys.argv:
    _run_under_interpreter()
