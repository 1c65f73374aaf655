"""`blockzoo_testing.triton_interpreter`: a bf16 `tl.dot` under Triton's interpreter, once `patch_bf16_dots()` has run,
equals torch's product of the same bf16 values (exact products, summed in float64 here: within fp32 rounding)."""

import sys

import torch

from blockzoo_testing.triton_interpreter import patch_bf16_dots, patch_for_numpy, run_interpreter_cases


def check_bf16_dot() -> None:
    import triton
    import triton.language as tl

    @triton.jit
    def product(a_pointer, b_pointer, output_pointer, SIZE: tl.constexpr):
        rows = tl.arange(0, SIZE)
        square = rows[:, None] * SIZE + rows[None, :]
        a = tl.load(a_pointer + square)
        b = tl.load(b_pointer + square).to(tl.float32)  # a bf16 operand made in registers, too
        tl.store(output_pointer + square, tl.dot(a, b.to(tl.bfloat16)))

    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(32, 32, generator=generator).to(torch.bfloat16) for _ in range(2))
    output = torch.empty(32, 32)
    product[(1,)](a, b, output, SIZE=32)
    expected = a.double() @ b.double()
    error = float((output.double() - expected).abs().max() / expected.abs().max())
    print(f"bf16 dot under the interpreter: largest error {error:.1e} of the largest product")
    if not error < 1e-6:
        sys.exit(f"bf16 dot under the interpreter: error {error:.1e}")


def test_bf16_dots_under_the_interpreter_equal_torchs():
    run_interpreter_cases(__file__)


if __name__ == "__main__":
    patch_for_numpy()
    patch_bf16_dots()
    check_bf16_dot()
