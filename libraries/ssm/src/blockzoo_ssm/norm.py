"""Gated, grouped RMSNorm: Mamba 2's norm of the scan output gated by z (mamba_ssm's `norm_before_gate`, either
order)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blockzoo_ssm.kernels import mamba_gated_rms_norm, mamba_ssm_available


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor,
    *,
    epsilon: float,
    group_size: int,
    norm_before_gate: bool = False,
) -> torch.Tensor:
    """RMSNorm over each contiguous group of `group_size` channels of `x * silu(gate)`, times `weight`
    (`norm_before_gate`: RMSNorm of x, times `weight`, then times `silu(gate)`).

    x, gate: [..., channels] (gate None: a plain grouped RMSNorm); weight: [channels]. Computed in fp32 (float64
    for float64 inputs); the output has the dtype of `x`. group_size = channels normalizes over all channels (HF
    Mamba2, Bamba); channels / groups per group matches mamba_ssm's Mamba2, NemotronH and Zamba2. On CUDA with
    mamba_ssm installed, its fused Triton kernel computes the same.
    """
    channels = x.shape[-1]
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gated_rms_norm: gate shape {tuple(gate.shape)} differs from x shape {tuple(x.shape)}")
    if weight.shape != (channels,):
        raise ValueError(f"gated_rms_norm: weight must have shape ({channels},), got {tuple(weight.shape)}")
    if group_size <= 0 or channels % group_size != 0:
        raise ValueError(f"gated_rms_norm: group_size ({group_size}) must divide the channels ({channels})")
    if x.is_cuda and mamba_ssm_available():
        return mamba_gated_rms_norm(
            x, gate, weight, epsilon=epsilon, group_size=group_size, norm_before_gate=norm_before_gate
        )
    dtype = torch.promote_types(x.dtype, torch.float32)
    hidden = x.to(dtype)
    if gate is not None and not norm_before_gate:
        hidden = hidden * F.silu(gate.to(dtype))
    grouped = hidden.unflatten(-1, (channels // group_size, group_size))
    normalized = grouped * torch.rsqrt(grouped.square().mean(-1, keepdim=True) + epsilon)
    output = normalized.flatten(-2) * weight.to(dtype)
    if gate is not None and norm_before_gate:
        output = output * F.silu(gate.to(dtype))
    return output.to(x.dtype)
