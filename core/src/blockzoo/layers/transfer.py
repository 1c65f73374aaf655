"""Host tensors placed on the device: on a GPU copied from pinned memory without waiting for the device, several of
one dtype in one copy (placing a batch is one transfer)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host `tensor` on `device`; on a GPU copied from pinned memory without waiting for the device."""
    if device.type == "cpu":
        return tensor
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def to_device_together(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host `tensors` of one dtype on `device` in one copy (each a view of it): on a GPU, from one pinned buffer
    without waiting, so placing a batch costs one transfer, not one per tensor."""
    if device.type == "cpu":
        return list(tensors)
    sizes = [tensor.numel() for tensor in tensors]
    buffer = torch.empty(sum(sizes), dtype=tensors[0].dtype, pin_memory=device.type == "cuda")
    torch.cat([tensor.reshape(-1) for tensor in tensors], out=buffer)
    moved = buffer.to(device, non_blocking=True)
    return [view.view(tensor.shape) for view, tensor in zip(moved.split(sizes), tensors)]
