"""A linear layer's input given as gate‖up and an activation: the hidden layer `activation(m · gate) · up` of a gated
MLP, handed to its down projection unmade.

`GatedInput` goes from the MLP to the down projection (`Linear`), which multiplies it by its weight with
`linear`. For SwiGLU (silu) on CUDA that product is one autograd function that keeps gate‖up and the weight, not
the hidden layer: its backward computes the hidden layer's gradient, then one Triton kernel
(`blockzoo.layers.triton_gated`) reads gate, up and that gradient once and writes the gradient of gate‖up and the
hidden layer again, for the weight's gradient. That is the memory torch.compile's partitioner reaches for the plain
formulation (it recomputes the hidden layer too) with less traffic, and less memory than eager autograd, which keeps
the hidden layer as well. Elsewhere (other activations, the CPU, no gradient wanted) the hidden layer is made and
multiplied plainly: the reference the fused path is tested against.
"""

from __future__ import annotations

import importlib.util
from typing import NamedTuple

import torch
import torch.nn.functional as F

from blockzoo.layers.activations import ACTIVATIONS

# The fused SwiGLU product on CUDA (the plain one otherwise: a switch for measurements).
FUSED_ON_CUDA = True
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


class GatedInput(NamedTuple):
    """`activation(multiplier · gate) · up` from `projected` = gate‖up `[tokens, 2n]` (gate columns first). A named
    tuple: torch.compile traces through it."""

    projected: torch.Tensor
    activation: str
    multiplier: float = 1.0

    @property
    def dtype(self) -> torch.dtype:
        return self.projected.dtype

    def materialized(self) -> torch.Tensor:
        """The hidden layer `[tokens, n]` as a tensor."""
        gate, up = self.projected.chunk(2, dim=-1)
        if self.multiplier != 1:
            gate = gate * self.multiplier
        return ACTIVATIONS[self.activation](gate) * up

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`F.linear(hidden layer, weight, bias)`, through the fused SwiGLU product where it applies."""
        if not _fused(self, weight):
            return F.linear(self.materialized(), weight, bias)
        output = SiluGatedLinear.apply(self.projected, weight, self.multiplier)
        return output if bias is None else output + bias


def linear(input: torch.Tensor | GatedInput, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` of a tensor or of a `GatedInput`."""
    if isinstance(input, GatedInput):
        return input.linear(weight, bias)
    return F.linear(input, weight, bias)


def _fused(gated: GatedInput, weight: torch.Tensor) -> bool:
    projected = gated.projected
    return (
        FUSED_ON_CUDA
        and gated.activation == "silu"
        and projected.is_cuda
        and projected.ndim == 2
        and projected.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and weight.dtype == projected.dtype
        and torch.is_grad_enabled()
        and (projected.requires_grad or weight.requires_grad)
        and _TRITON_INSTALLED
    )


class SiluGatedLinear(torch.autograd.Function):
    """`F.linear(silu(m · gate) · up, weight)` keeping gate‖up and the weight for the backward, not the hidden layer."""

    @staticmethod
    def forward(ctx, projected: torch.Tensor, weight: torch.Tensor, multiplier: float) -> torch.Tensor:
        ctx.save_for_backward(projected, weight)
        ctx.multiplier = multiplier
        return F.linear(GatedInput(projected, "silu", multiplier).materialized(), weight)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        projected, weight = ctx.saved_tensors
        grad_projected, hidden = silu_gate_backward(projected, grad_output @ weight, ctx.multiplier)
        grad_weight = grad_output.T @ hidden if ctx.needs_input_grad[1] else None
        return grad_projected, grad_weight, None


# An operator, so torch.compile calls the kernel as it is (inside compiled blocks) rather than tracing into it.
@torch.library.custom_op("blockzoo::silu_gate_backward", mutates_args=())
def silu_gate_backward(
    projected: torch.Tensor, grad: torch.Tensor, multiplier: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gradient of gate‖up, the hidden layer) — see `blockzoo.layers.triton_gated`; the Triton kernel on CUDA, the
    same arithmetic in torch ops elsewhere (in fp32 or wider, rounded once to the inputs' dtype)."""
    projected, grad = projected.contiguous(), grad.contiguous()
    if projected.is_cuda:
        from blockzoo.layers.triton_gated import silu_gate_backward as kernel

        return kernel(projected, grad, multiplier)
    compute = torch.promote_types(projected.dtype, torch.float32)
    gate, up = (part.to(compute) for part in projected.chunk(2, dim=-1))
    gate = gate * multiplier
    grad = grad.to(compute)
    sigmoid = torch.sigmoid(gate)
    silu = gate * sigmoid
    grad_gate = grad * up * sigmoid * (1 + gate * (1 - sigmoid)) * multiplier
    grad_projected = torch.cat([grad_gate, grad * silu], dim=-1).to(projected.dtype)
    return grad_projected, (silu * up).to(projected.dtype)


@silu_gate_backward.register_fake
def _(projected: torch.Tensor, grad: torch.Tensor, multiplier: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(projected, memory_format=torch.contiguous_format), torch.empty_like(
        grad, memory_format=torch.contiguous_format
    )
