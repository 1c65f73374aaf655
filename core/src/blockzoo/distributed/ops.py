"""Autograd-aware collectives of tensor parallelism, for activations packed as `[tokens, features]`.

Every op takes the tensor-parallel group, which may be None (a single process) or of size one: the
op is then the identity. The pairs are each other's transpose:

- `copy_to_tensor_region`: identity forward, all-reduce backward (input of a column-parallel linear).
- `reduce_from_tensor_region`: all-reduce forward, identity backward (output of a row-parallel linear).
- `gather_tokens`: all-gather along tokens forward, reduce-scatter backward (sequence-tensor-parallel
  input of a column-parallel linear).
- `reduce_scatter_tokens`: reduce-scatter along tokens forward, all-gather backward (sequence-tensor-
  parallel output of a row-parallel linear).
- `split_tokens`: keep this rank's token chunk forward, all-gather backward (entering the
  sequence-tensor-parallel region, e.g. after the embeddings).
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

# `all_gather_single` / `reduce_scatter_single` replace the `*_into_tensor` / `*_tensor` names in newer torch.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _is_single(group: ProcessGroup | None) -> bool:
    return group is None or group.size() == 1


def all_gather_tensors(tensor: torch.Tensor, group: ProcessGroup) -> list[torch.Tensor]:
    """Every rank's `tensor` (same shape on all ranks), in group-rank order. Not differentiable."""
    flat = tensor.detach().reshape(-1).contiguous()
    gathered = flat.new_empty(group.size() * flat.numel())
    _all_gather_single(gathered, flat, group=group)
    return [part.view(tensor.shape) for part in gathered.chunk(group.size())]


def _token_chunk_size(tokens: int, group: ProcessGroup) -> int:
    if tokens % group.size():
        raise ValueError(
            f"sequence-tensor-parallel needs the token count ({tokens}) to be a multiple of the "
            f"tensor-parallel size ({group.size()})"
        )
    return tokens // group.size()


def _all_reduce(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    # A fresh buffer: the incoming tensor may be shared with another branch of the graph.
    reduced = tensor.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(reduced, group=group)
    return reduced


def _all_gather_tokens(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    gathered = tensor.new_empty((tensor.shape[0] * group.size(), *tensor.shape[1:]))
    _all_gather_single(gathered, tensor.contiguous(), group=group)
    return gathered


def _reduce_scatter_tokens(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    scattered = tensor.new_empty((_token_chunk_size(tensor.shape[0], group), *tensor.shape[1:]))
    _reduce_scatter_single(scattered, tensor.contiguous(), group=group)
    return scattered


def _own_tokens(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    size = _token_chunk_size(tensor.shape[0], group)
    return tensor.narrow(0, group.rank() * size, size).contiguous()


def _unchanged(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return tensor.view_as(tensor)  # a view: autograd records the op's output as a tensor of its own


def _collective(
    name: str,
    forward: Callable[[torch.Tensor, ProcessGroup], torch.Tensor],
    backward: Callable[[torch.Tensor, ProcessGroup], torch.Tensor],
) -> type[torch.autograd.Function]:
    """An autograd function `name` over a process group: `forward(tensor, group)` forward, `backward(grad, group)` on
    the gradient backward. Built under its own name (not renamed after), so that profiler traces, errors and compiled
    graphs tell the collectives apart, and its backward node is `<name>Backward`."""

    def apply_forward(ctx, tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return forward(tensor, group)

    def apply_backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return backward(grad, ctx.group), None

    def body(namespace: dict) -> None:
        namespace.update(forward=staticmethod(apply_forward), backward=staticmethod(apply_backward))
        namespace.update(__module__=__name__, __qualname__=name)

    # `types.new_class` calls the metaclass, which names the backward node after the class.
    return types.new_class(name, (torch.autograd.Function,), exec_body=body)


_CopyToTensorRegion = _collective("CopyToTensorRegion", _unchanged, _all_reduce)
_ReduceFromTensorRegion = _collective("ReduceFromTensorRegion", _all_reduce, _unchanged)
_GatherTokens = _collective("GatherTokens", _all_gather_tokens, _reduce_scatter_tokens)
_ReduceScatterTokens = _collective("ReduceScatterTokens", _reduce_scatter_tokens, _all_gather_tokens)
_SplitTokens = _collective("SplitTokens", _own_tokens, _all_gather_tokens)


def copy_to_tensor_region(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Enter the tensor-parallel region: the identity forward, the gradient summed over `group` backward (the
    input of a column-parallel product)."""
    return tensor if _is_single(group) else _CopyToTensorRegion.apply(tensor, group)


def reduce_from_tensor_region(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Leave the tensor-parallel region: the ranks' partial sums all-reduced over `group` forward, the identity
    backward (the output of a row-parallel product)."""
    return tensor if _is_single(group) else _ReduceFromTensorRegion.apply(tensor, group)


def gather_tokens(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sequence-tensor parallelism: the token-split `[tokens, ...]` shards all-gathered along tokens (rank order)
    forward, the gradient reduce-scattered back to each rank's tokens."""
    return tensor if _is_single(group) else _GatherTokens.apply(tensor, group)


def reduce_scatter_tokens(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sequence-tensor parallelism: partial sums over all tokens reduce-scattered to each rank's contiguous share
    of the tokens forward, the gradient all-gathered backward. Every op is the identity without a group."""
    return tensor if _is_single(group) else _ReduceScatterTokens.apply(tensor, group)


def split_tokens(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return tensor if _is_single(group) else _SplitTokens.apply(tensor, group)
