"""The fused cross-entropy's Triton chunk kernel (`blockzoo.layers.cross_entropy_kernel`) under Triton's interpreter on
CPU tensors: each row's log-sum-exp, target logit and gradient against float64, for fp32 and bf16 logits, rows of
several blocks with a partial last one, of exact blocks and shorter than one block, ignored tokens and a target not
among the columns; and `linear_cross_entropy(kernel="triton")` against F.cross_entropy on float64 logits.

Here, not in the core's tests: the interpreter runs come from blockzoo-testing, and triton is installed with the
plugins' test extras (the GPU test in core/tests/test_cross_entropy.py times the kernel against the compiled chunk).
"""

import sys

import pytest
import torch
import torch.nn.functional as F

from blockzoo_testing.triton_interpreter import patch_for_numpy, run_interpreter_cases

# (dtype, columns, block): three blocks with a partial last one; exact blocks; fewer columns than a block.
ROW_CASES = [
    (torch.float32, 300, 128),
    (torch.bfloat16, 300, 128),
    (torch.float32, 256, 64),
    (torch.bfloat16, 100, 128),
]
# fp32: the kernel's fp32 sums against float64. bf16 logits are exact in fp32; the gradient, of magnitude at most 1,
# is written in bf16: within a unit in its last place, 2⁻⁸ (the interpreter's conversion truncates, where the GPU's
# rounds to nearest, within half of it).
TOLERANCES = {torch.float32: {"lse": 1e-6, "gradient": 1e-6}, torch.bfloat16: {"lse": 1e-6, "gradient": 2**-8}}


def row_errors(dtype: torch.dtype, columns: int, block: int) -> dict[str, float]:
    """The largest error of the log-sum-exp (relative), target logit and gradient (absolute) against float64."""
    from blockzoo.layers.cross_entropy_kernel import loss_and_gradient

    generator = torch.Generator().manual_seed(columns)
    rows = 9
    logits = (torch.randn(rows, columns, generator=generator) * 4).to(dtype)
    targets = torch.randint(0, columns, (rows,), generator=generator)
    targets[3] = columns - 1  # the last column, in the last block
    labelled = torch.ones(rows, dtype=torch.bool)
    labelled[[0, 5]] = False  # ignored tokens: no target, a zero gradient
    targets[[0, 5]] = -1
    targets[2] = -1  # labelled, its target among another rank's columns: no one-hot here

    exact = logits.double()
    expected_lse = exact.logsumexp(1)
    hit = targets >= 0
    expected_target = torch.where(hit, exact.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
    expected_gradient = exact.softmax(1)
    expected_gradient[hit.nonzero().squeeze(1), targets[hit]] -= 1
    expected_gradient[~labelled] = 0

    written = logits.clone()
    lse, target, gradient = loss_and_gradient(written, targets, labelled, block=block)
    assert gradient.data_ptr() == written.data_ptr() and gradient.dtype == dtype  # over the logits
    assert lse.dtype == target.dtype == torch.float32
    return {
        "lse": float(((lse.double() - expected_lse).abs() / expected_lse.abs()).max()),
        "target": float((target.double() - expected_target).abs().max()),
        "gradient": float((gradient.double() - expected_gradient).abs().max()),
    }


def check_rows() -> list[str]:
    failures = []
    for dtype, columns, block in ROW_CASES:
        errors = row_errors(dtype, columns, block)
        print(f"{dtype} {columns} columns, blocks of {block}: {errors}", flush=True)
        allowed = {"target": 0.0, **TOLERANCES[dtype]}
        failures += [f"{dtype} {columns}/{block}: {name} {value:.2e} > {allowed[name]}"
                     for name, value in errors.items() if not value <= allowed[name]]  # fmt: skip
    return failures


def check_loss() -> list[str]:
    """The loss and both gradients through the kernel, in chunks of 7 tokens, against float64 (fp32 inputs)."""
    from blockzoo.layers.cross_entropy import linear_cross_entropy

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=generator).requires_grad_()
    weight = (torch.randn(50, 16, generator=generator) * 0.5).requires_grad_()
    labels = torch.randint(0, 50, (37,), generator=generator)
    labels[::5] = -100
    loss = linear_cross_entropy(hidden, weight, labels, chunk_tokens=7, kernel="triton")
    (loss * 0.37).backward()
    hidden64, weight64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    expected = F.cross_entropy(hidden64 @ weight64.T, labels, ignore_index=-100, reduction="sum")
    (expected * 0.37).backward()
    failures = []
    for name, value, reference in (
        ("loss", loss, expected),
        ("hidden's gradient", hidden.grad, hidden64.grad),
        ("weight's gradient", weight.grad, weight64.grad),
    ):
        reference = reference.detach()
        error = float((value.detach().double() - reference).abs().max() / reference.abs().max())
        print(f"linear_cross_entropy(kernel='triton'): {name} relative error {error:.2e}", flush=True)
        if not error <= 1e-5:
            failures.append(f"{name}: {error:.2e} > 1e-5")
    return failures


def test_the_kernel_matches_float64():
    run_interpreter_cases(__file__, overflow_is_error=True)


def test_the_kernel_compiles_for_a_hopper_gpu():
    """Compiled for sm_90 with bf16 logits at the default launch and those the kernels suite times (Triton compiles
    for a named target without a GPU; the interpreter checks neither the types the compiler infers nor the shared
    memory)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from benchmarks.kernels import CROSS_ENTROPY_LAUNCHES
    from blockzoo.layers import cross_entropy_kernel as launch

    kernel = launch._loss_and_gradient_kernel
    types = {"logits_pointer": "*bf16", "targets_pointer": "*i64", "labelled_pointer": "*i1", "lse_pointer": "*fp32"}
    types |= {"target_logit_pointer": "*fp32", "row_stride": "i64", "columns": "i32", "BLOCK": "constexpr"}
    for block, warps in {(launch.BLOCK, launch.WARPS), *CROSS_ENTROPY_LAUNCHES}:
        source = ASTSource(kernel, {name: types[name] for name in kernel.arg_names}, constexprs={"BLOCK": block})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        assert 0 <= compiled.metadata.shared <= 227 * 1024, (block, warps, compiled.metadata.shared)


if __name__ == "__main__":
    patch_for_numpy()
    found = check_rows() + check_loss()
    print("\n".join(found) or "all cases passed")
    sys.exit(1 if found else 0)
