"""The fused SwiGLU product (`blockzoo.layers.gated`) against float64 autograd of the plain formulation written here:
`F.linear(silu(m · gate) · up, weight)` from gate‖up, its output and the gradients of gate‖up and of the weight.

On the CPU the autograd function runs its operator's torch arithmetic; where triton is importable, the Triton kernel
runs under Triton's interpreter on CPU tensors, in a subprocess (see triton_interpreter.py). The `gpu` tests run the
compiled kernel on CUDA, the dense MLP with and without it, and under torch.compile. Errors are relative:
‖value − reference‖ / ‖reference‖.
"""

import sys

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import patch_for_numpy, run_interpreter_cases

from blockzoo.layers import gated
from blockzoo.layers.gated import GatedInput, SiluGatedLinear

FP32_TOLERANCE = 1e-5
BF16_TOLERANCE = 1e-2  # bf16 inputs, outputs and gradients; the reference sees the same rounded inputs


def reference(projected: torch.Tensor, weight: torch.Tensor, multiplier: float) -> torch.Tensor:
    gate, up = projected.chunk(2, dim=-1)
    return F.linear(F.silu(gate * multiplier) * up, weight)


def error(value: torch.Tensor, expected: torch.Tensor) -> float:
    return float((value.detach().cpu().double() - expected.detach()).norm() / expected.detach().norm())


def fused_errors(tokens, width, hidden, multiplier, dtype, device, seed=0) -> dict[str, float]:
    """{"output": error, "projected": error of its gradient, "weight": ...} of `SiluGatedLinear` against float64
    autograd of `reference` on the same (rounded) inputs."""
    generator = torch.Generator().manual_seed(seed)
    projected = torch.randn(tokens, 2 * width, generator=generator).to(dtype)
    weight = (torch.randn(hidden, width, generator=generator) * width**-0.5).to(dtype)
    output_grad = torch.randn(tokens, hidden, generator=generator).to(dtype)
    leaves = [tensor.to(device, copy=True).requires_grad_() for tensor in (projected, weight)]
    output = SiluGatedLinear.apply(*leaves, multiplier)
    output.backward(output_grad.to(device))
    exact = [tensor.double().requires_grad_() for tensor in (projected, weight)]
    expected = reference(*exact, multiplier)
    expected.backward(output_grad.double())
    assert output.dtype == dtype and all(leaf.grad.dtype == dtype for leaf in leaves)
    return {
        "output": error(output, expected),
        "projected": error(leaves[0].grad, exact[0].grad),
        "weight": error(leaves[1].grad, exact[1].grad),
    }


@pytest.mark.parametrize("multiplier", [1.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_product_matches_float64_autograd(dtype, multiplier):
    errors = fused_errors(37, 24, 16, multiplier, dtype, torch.device("cpu"))
    tolerance = FP32_TOLERANCE if dtype == torch.float32 else BF16_TOLERANCE
    assert max(errors.values()) <= tolerance, errors


def test_the_backward_keeps_gate_up_and_the_weight_not_the_hidden_layer():
    projected = torch.randn(8, 2 * 6, requires_grad=True)
    weight = torch.randn(4, 6, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda tensor: saved.append(tensor) or tensor, lambda tensor: tensor):
        SiluGatedLinear.apply(projected, weight, 1.0)
    assert [tensor.shape for tensor in saved] == [projected.shape, weight.shape]


def test_under_torch_compile_the_forward_keeps_no_hidden_layer():
    """Traced by torch.compile (as in a compiled block, after gate‖up's own product), the forward graph's saved
    tensors hold no `[tokens, n]` hidden layer, and values and gradients equal the eager ones."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    tokens, width, hidden = 16, 12, 8
    forward_graphs = []

    def keep_forward(graph, inputs):
        forward_graphs.append(graph)
        return make_boxed_func(graph)

    backend = aot_autograd(fw_compiler=keep_forward, bw_compiler=lambda graph, inputs: make_boxed_func(graph))

    def mlp(x, gate_up, down):
        return SiluGatedLinear.apply(F.linear(x, gate_up), down, 0.5)

    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(*shape, generator=generator) for shape in [(tokens, 5), (2 * width, 5), (hidden, width)]]
    results = []
    for function in (mlp, torch.compile(mlp, backend=backend, fullgraph=True)):
        leaves = [tensor.clone().requires_grad_() for tensor in tensors]
        output = function(*leaves)
        output.square().sum().backward()
        results.append([output, *(leaf.grad for leaf in leaves)])
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager)
    (graph,) = forward_graphs
    (outputs,) = [node.args[0] for node in graph.graph.nodes if node.op == "output"]
    shapes = [tuple(node.meta["val"].shape) for node in outputs[1:]]  # what the forward keeps for the backward
    assert (tokens, width) not in shapes and (tokens, 2 * width) in shapes, shapes


def test_a_gated_input_multiplies_like_its_hidden_layer_off_the_fused_path():
    """Without a gradient wanted, with another activation or on the CPU, `linear` makes the hidden layer."""
    projected, weight, bias = torch.randn(5, 8), torch.randn(3, 4), torch.randn(3)
    for activation in ("silu", "gelu", "relu"):
        gated_input = GatedInput(projected, activation, 2.0)
        gate, up = projected.chunk(2, dim=-1)
        expected = F.linear({"silu": F.silu, "gelu": F.gelu, "relu": F.relu}[activation](2 * gate) * up, weight, bias)
        torch.testing.assert_close(gated.linear(gated_input, weight, bias), expected)


# -- the Triton kernel ------------------------------------------------------------------------------------------------

# (tokens, width, multiplier, dtype): widths below, at and across the kernel's column block (1024), odd ones masked.
KERNEL_CASES = [
    (5, 24, 1.0, torch.float32),
    (3, 1030, 0.5, torch.float32),
    (4, 40, 1.0, torch.bfloat16),
]
# The kernel reads gate‖up and the gradient where they lie: rows of wider tensors, from this column.
OFFSET = 3


def kernel_errors(tokens, width, multiplier, dtype, device, seed=0) -> dict[str, float]:
    """{"grad_projected": error, "hidden": error} of the kernel against float64 autograd of silu(m · gate) · up."""
    from blockzoo.layers.triton_gated import silu_gate_backward

    generator = torch.Generator().manual_seed(seed)
    wide = torch.randn(tokens, OFFSET + 2 * width + 5, generator=generator).to(dtype)
    grad_wide = torch.randn(tokens, width + 7, generator=generator).to(dtype)
    projected, grad = wide[:, OFFSET : OFFSET + 2 * width], grad_wide[:, :width]
    grad_projected, hidden = silu_gate_backward(projected.to(device), grad.to(device), multiplier)
    exact = projected.double().requires_grad_()
    gate, up = exact.chunk(2, dim=-1)
    expected_hidden = F.silu(gate * multiplier) * up
    expected_hidden.backward(grad.double())
    assert grad_projected.dtype == dtype and hidden.dtype == dtype
    return {"grad_projected": error(grad_projected, exact.grad), "hidden": error(hidden, expected_hidden)}


def check_kernel_cases(device) -> list[str]:
    failures = []
    for tokens, width, multiplier, dtype in KERNEL_CASES:
        errors = kernel_errors(tokens, width, multiplier, dtype, device)
        tolerance = FP32_TOLERANCE if dtype == torch.float32 else BF16_TOLERANCE
        case = f"tokens={tokens} width={width} multiplier={multiplier} {dtype}"
        print(f"{case}: max relative error {max(errors.values()):.2e}", flush=True)
        failures += [
            f"{case}: {name} {value:.2e} > {tolerance}" for name, value in errors.items() if not value <= tolerance
        ]
    return failures


def _run_under_interpreter() -> None:
    """Entry point of the interpreter subprocess (TRITON_INTERPRET=1 in its environment)."""
    patch_for_numpy()
    failures = check_kernel_cases(torch.device("cpu"))
    if failures:
        sys.exit("\n".join(failures))


def test_interpreter_matches_float64_autograd():
    run_interpreter_cases(__file__)


# -- on CUDA -----------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_kernel_matches_float64_autograd():
    assert check_kernel_cases(torch.device("cuda")) == []
    errors = fused_errors(4096, 1024, 512, 1.0, torch.bfloat16, torch.device("cuda"))
    assert max(errors.values()) <= BF16_TOLERANCE, errors


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_gpu_dense_mlp_fused_matches_the_plain_product(monkeypatch, compile):
    """The dense MLP (SwiGLU, bf16, gate multiplier) on CUDA: its output and every gradient with the fused product
    against the plain one, eager and under torch.compile."""
    from blockzoo.distributed.config import DistributedConfig
    from blockzoo.distributed.runtime import Distributed
    from blockzoo.layers.base import Batch
    from blockzoo.layers.dims import TensorDim
    from blockzoo_mlp.config import DenseMLPConfig
    from blockzoo_mlp.mlp import DenseMLP

    torch.manual_seed(0)
    config = DenseMLPConfig(intermediate_size=384, gated=True, gate_multiplier=0.5)
    distributed = Distributed(DistributedConfig())
    mlp = DenseMLP(config, name="mlp", hidden_dim=TensorDim("hidden", 128), distributed=distributed, lr_scale=1.0)
    mlp = mlp.cuda()
    hidden = torch.randn(1000, 128, device="cuda", dtype=torch.bfloat16)
    output_grad = torch.randn(1000, 128, device="cuda", dtype=torch.bfloat16)
    batch = Batch([600, 400], device="cuda")
    results = {}
    for fused in (False, True):
        monkeypatch.setattr(gated, "FUSED_ON_CUDA", fused)
        torch._dynamo.reset()
        forward = torch.compile(mlp.forward) if compile else mlp.forward
        leaf = hidden.clone().requires_grad_()
        mlp.zero_grad(set_to_none=True)
        output = forward(leaf, batch)
        output.backward(output_grad)
        results[fused] = [output, leaf.grad, *(parameter.grad for parameter in mlp.parameters())]
    for plain, fused in zip(results[False], results[True]):
        assert float((fused.double() - plain.double()).norm() / plain.double().norm()) <= BF16_TOLERANCE


if __name__ == "__main__" and "--interpreter" in sys.argv:
    _run_under_interpreter()
