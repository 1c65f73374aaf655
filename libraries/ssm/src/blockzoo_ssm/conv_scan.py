"""The Mamba 2 mixer's convolution and SSD scan as one step that keeps the convolution's input, not its output.

mamba_ssm's SSD kernels keep their inputs x, B and C for the backward pass: the causal convolution's output, a
[tokens, x‖B‖C] tensor per layer (the Mamba 2 LM's 1.3B shape at 16384 tokens: 143 MB a layer, 6.2 GiB over 48
layers, the second largest item at the step's peak; benchmarks/RESULTS.md, 2026-12-03). Here what is kept is the
convolution's input (a view of in_proj's output, which the gate keeps anyway) and the scan's output: the backward
pass runs the convolution again, the scan's backward on it, then the convolution's backward — as mamba_ssm's own
fused layer (`mamba_split_conv1d_scan_combined`) does. The cost: one more convolution forward per layer.

On the kernel path only (CUDA, mamba_ssm's SSD kernels and the project's convolution kernels, no generation state,
no slice); elsewhere `convolved_ssd_scan` is the convolution then `ssd_scan`, the same function of its inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch

from blockzoo.layers.base import Batch
from blockzoo_ssm.conv import _int32_positions, causal_conv1d, uses_triton_kernel
from blockzoo_ssm.kernels import mamba_ssm_available, ssd_combined
from blockzoo_ssm.scan import _int32_document_index, ssd_scan


@attrs.frozen
class ScanLayout:
    """How the convolution's channels split into the scan's x, B and C: their widths, and the sizes of x's heads
    and of B's and C's groups."""

    widths: tuple[int, int, int]
    head_size: int
    state_size: int

    def split(self, convolved: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views x [tokens, heads, head_size], B and C [tokens, groups, state_size] of `convolved`."""
        x, b, c = convolved.split(self.widths, dim=-1)
        return (
            x.unflatten(-1, (-1, self.head_size)),
            b.unflatten(-1, (-1, self.state_size)),
            c.unflatten(-1, (-1, self.state_size)),
        )


def convolved_ssd_scan(
    xbc: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dt: torch.Tensor,
    A: torch.Tensor,
    batch: Batch,
    layout: ScanLayout,
    *,
    chunk_size: int,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: Sequence[float] = (0.0, math.inf),
) -> torch.Tensor:
    """`ssd_scan` of x, B, C = `layout.split(silu(causal_conv1d(xbc, weight, bias)))` with the time step from dt
    (as `ssd_scan`'s: + dt_bias, softplus, clamped to dt_limit), skip `D`: y [tokens, heads, head_size] in xbc's
    dtype. On the kernel path the convolution's output is not kept for the backward pass (the module's docstring)."""
    scan_options = {"chunk_size": chunk_size, "D": D, "dt_bias": dt_bias, "dt_softplus": dt_softplus}
    if not uses_kernels(xbc, weight):
        x, b, c = layout.split(causal_conv1d(xbc, weight, bias, batch, activation="silu"))
        return ssd_scan(x, dt, A, b, c, batch, **scan_options, dt_limit=dt_limit)
    if xbc.stride(1) != 1:  # the kernels read rows of contiguous channels
        xbc = xbc.contiguous()
    options = (layout, chunk_size, dt_softplus, tuple(dt_limit))
    skip = None if D is None else D.float()
    positions, seq_idx = _int32_positions(batch), _int32_document_index(batch)
    return _ConvolvedScan.apply(
        xbc, weight.contiguous(), bias, dt, A.float(), skip, dt_bias, positions, seq_idx, options
    )


def uses_kernels(xbc: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `convolved_ssd_scan` takes the kernel path for these inputs."""
    return uses_triton_kernel(xbc, weight, None) and mamba_ssm_available()


class _ConvolvedScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xbc, weight, bias, dt, A, D, dt_bias, positions, seq_idx, options):
        layout, chunk_size, dt_softplus, dt_limit = options
        x, b, c = layout.split(_convolve(xbc, weight, bias, positions))
        out, *_ = ssd_combined()._mamba_chunk_scan_combined_fwd(
            x[None], dt[None], A, b[None], c[None], chunk_size, D=D, dt_bias=dt_bias, seq_idx=seq_idx[None],
            dt_softplus=dt_softplus, dt_limit=dt_limit,
        )  # fmt: skip
        ctx.save_for_backward(xbc, weight, bias, dt, A, D, dt_bias, positions, seq_idx, out)
        ctx.options = options
        return out[0]

    @staticmethod
    def backward(ctx, dout):
        xbc, weight, bias, dt, A, D, dt_bias, positions, seq_idx, out = ctx.saved_tensors
        layout, chunk_size, dt_softplus, dt_limit = ctx.options
        from blockzoo_ssm.triton_conv import conv_backward

        convolved = _convolve(xbc, weight, bias, positions)  # again: what the forward pass did not keep
        x, b, c = layout.split(convolved)
        dconvolved = torch.empty_like(convolved)  # the scan's backward writes dx, dB, dC into its columns
        dx, db, dc = layout.split(dconvolved)
        _, ddt, dA, _, _, dD, _, ddt_bias, _ = ssd_combined()._mamba_chunk_scan_combined_bwd(
            dout[None], x[None], dt[None], A, b[None], c[None], out, chunk_size, D=D, dt_bias=dt_bias,
            seq_idx=seq_idx[None], dt_softplus=dt_softplus, dt_limit=dt_limit, dx=dx[None], dB=db[None], dC=dc[None],
        )  # fmt: skip
        dxbc, dweight, dbias = conv_backward(xbc, weight, bias, positions, True, dconvolved)
        return dxbc, dweight, dbias, ddt[0], dA, dD, ddt_bias, None, None, None


def _convolve(xbc, weight, bias, positions) -> torch.Tensor:
    from blockzoo_ssm.triton_conv import conv_forward

    return conv_forward(xbc, weight, bias, positions, True)
