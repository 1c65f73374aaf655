"""Autograd-aware exchanges between the slices of a sequence-data-parallel group (`SequenceData.group`).

The slices of a group are consecutive tokens held by its ranks in rank order; a mixer's `forward_slice` uses these to
get what its slice needs of the others, and their backward passes return every gradient to the rank whose tensor it
belongs to. Every op takes the group, which may be None (a single process): then the op acts on a group of one.
Every rank of the group must call the op with tensors of the same shape and dtype (a collective).

- `gather_slices(tensor, group)`: every rank's tensor concatenated along dim 0, in rank order (all-gather);
  backward: each rank gets the sum over the ranks of the gradients of its part (reduce-scatter). Attention's keys
  and values; an SSM's per-slice final states, stacked.
- `previous_slice(tensor, group)`: the tensor of the rank before this one (zeros on rank 0); backward: the gradient
  goes back to that rank. A convolution's halo: the previous slice's last kernel_size - 1 inputs.
- `sum_over_slices(tensor, group)`: the sum over the ranks (all-reduce), the gradient passed through unchanged:
  statistics whose function every rank computes in full (MoE's routing statistics), each rank's objective holding
  it once, the parameter gradients being summed over the group afterwards.
- `gather_slices_detached(tensor, group)`: the all-gather without gradient (token positions, document boundaries).
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from blockzoo.distributed.ops import gather_tokens, reduce_from_tensor_region


def _size(group: ProcessGroup | None) -> int:
    return 1 if group is None else group.size()


def gather_slices(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """`[size · n, ...]`: every rank's `tensor` `[n, ...]` in rank order; the backward returns to each rank the sum
    of all ranks' gradients of its rows."""
    return gather_tokens(tensor, group)  # the same exchange as sequence-tensor parallelism's, over another group


def gather_slices_detached(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """`[size · n, ...]`: every rank's `tensor` `[n, ...]` in rank order, without gradient."""
    return gather_tokens(tensor.detach(), group)


def previous_slice(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """The `tensor` of the previous rank of the group (zeros on its first rank, and without a group); the gradient
    of the result goes back to that rank."""
    size = _size(group)
    if size == 1:
        return torch.zeros_like(tensor)
    rank, rows = group.rank(), len(tensor)
    gathered = gather_slices(tensor, group)
    if rank == 0:
        # Every rank takes part in the gather and its backward (collectives); the first one uses none of it.
        nothing = torch.zeros((), dtype=torch.bool, device=tensor.device)
        return torch.where(nothing, gathered[:rows], 0.0).to(tensor.dtype)
    return gathered[(rank - 1) * rows : rank * rows]


def sum_over_slices(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """The sum of `tensor` over the ranks of the group; the gradient passes through unchanged (see the module)."""
    return reduce_from_tensor_region(tensor, group)  # (tensor parallelism's row-parallel output: the same op)
