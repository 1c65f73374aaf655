"""The backward pass of SwiGLU's gating as one Triton kernel (used by `blockzoo.layers.gated` on CUDA).

For each token t and column j of the hidden layer, with gate = m · projected[t, j] and up = projected[t, n + j]
(the gate‖up projection, n columns each) and s = sigmoid(gate):

    hidden[t, j] = gate · s · up                                     (silu(gate) · up, recomputed)
    grad_projected[t, j] = grad[t, j] · up · s · (1 + gate · (1 − s)) · m
    grad_projected[t, n + j] = grad[t, j] · gate · s

One program per row and block of columns reads gate, up and grad once and writes the three results once, in fp32
arithmetic rounded to the inputs' dtype: the least memory traffic the step allows (torch.compile of the plain
formulation writes the gradient of gate‖up as a concatenation, whose halves each read the inputs again).

Imports triton: import it only on CUDA (or under TRITON_INTERPRET=1, the tests).
"""

import torch
import triton
import triton.language as tl

# Columns per program (a power of two); fewer for a narrower hidden layer.
BLOCK = 1024


@triton.jit
def _silu_gate_backward_kernel(
    projected_pointer,
    grad_pointer,
    grad_projected_pointer,
    hidden_pointer,
    width,
    projected_stride,
    grad_stride,
    multiplier,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = columns < width
    gate_pointers = projected_pointer + row * projected_stride + columns
    gate = tl.load(gate_pointers, mask=inside, other=0.0).to(tl.float32) * multiplier
    up = tl.load(gate_pointers + width, mask=inside, other=0.0).to(tl.float32)
    grad = tl.load(grad_pointer + row * grad_stride + columns, mask=inside, other=0.0).to(tl.float32)
    sigmoid = tl.sigmoid(gate)
    silu = gate * sigmoid
    dtype = grad_projected_pointer.dtype.element_ty
    output_pointers = grad_projected_pointer + row * (2 * width) + columns
    tl.store(output_pointers, (grad * up * sigmoid * (1 + gate * (1 - sigmoid)) * multiplier).to(dtype), mask=inside)
    tl.store(output_pointers + width, (grad * silu).to(dtype), mask=inside)
    tl.store(hidden_pointer + row * width + columns, (silu * up).to(dtype), mask=inside)


def silu_gate_backward(
    projected: torch.Tensor, grad: torch.Tensor, multiplier: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gradient of gate‖up `[tokens, 2n]`, the hidden layer silu(m · gate) · up `[tokens, n]`) from `projected`
    `[tokens, 2n]` and the hidden layer's gradient `grad` `[tokens, n]`, both with contiguous columns."""
    tokens, width = grad.shape
    if projected.shape != (tokens, 2 * width) or projected.stride(-1) != 1 or grad.stride(-1) != 1:
        raise ValueError(
            f"silu_gate_backward: projected {tuple(projected.shape)} and grad {tuple(grad.shape)} must be "
            "[tokens, 2n] and [tokens, n] with contiguous columns"
        )
    grad_projected = torch.empty_like(projected, memory_format=torch.contiguous_format)
    hidden = torch.empty_like(grad, memory_format=torch.contiguous_format)
    if tokens and width:
        block = min(BLOCK, triton.next_power_of_2(width))
        grid = (tokens, triton.cdiv(width, block))
        _silu_gate_backward_kernel[grid](
            projected, grad, grad_projected, hidden, width, projected.stride(0), grad.stride(0), multiplier, BLOCK=block
        )
    return grad_projected, hidden
