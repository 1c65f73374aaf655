"""Debug aid: do the ranks of a group hold the same copy of a tensor that should be replicated?"""

from __future__ import annotations

import logging

import attrs
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from blockzoo.distributed.ops import all_gather_tensors

logger = logging.getLogger(__name__)

# Shapes are exchanged as this many int64 (the dim count, then the sizes): enough for any activation or weight.
_MAX_DIMS = 15


class ParallelMismatchError(RuntimeError):
    """A tensor that should be replicated differs between ranks."""


@attrs.frozen
class Mismatch:
    """How the ranks' copies of a tensor differ from the copy of the group's first rank (`reference_rank`)."""

    count: int  # elements that differ on some rank, or are NaN
    elements: int
    ranks: tuple[int, ...]  # the (global) ranks whose copy differs
    reference_rank: int
    max_difference: float  # the largest absolute difference to the reference copy, NaNs left out
    nans: int  # NaNs over all copies

    def describe(self) -> str:
        return (
            f"{self.count} of {self.elements} elements differ between ranks or are NaN (ranks {list(self.ranks)} "
            f"differ from rank {self.reference_rank}; max difference {self.max_difference:.3g}; "
            f"{self.nans} NaNs over all copies)"
        )


def compare_across(
    tensor: torch.Tensor, group: ProcessGroup | None, *, atol: float = 0.0, rtol: float = 0.0
) -> Mismatch | None:
    """How the copies of `tensor` on the ranks of `group` differ, or None where they all agree within `atol` + `rtol`
    and hold no NaN (NaN never equals NaN).

    Every rank of `group` must call it, in the same order; every rank gets the same answer. Ranks whose shapes differ
    raise `ParallelMismatchError` (on every rank) naming each rank's shape. A single process (`group` None) only
    looks for NaNs.
    """
    ranks = [0] if group is None else dist.get_process_group_ranks(group)
    if group is not None:
        _check_shapes(tensor, group, ranks)
    copies = [tensor.detach()] if group is None else all_gather_tensors(tensor, group)
    reference = copies[0]
    mismatch = torch.zeros(reference.shape, dtype=torch.bool, device=reference.device)
    differing_ranks = []
    max_difference = 0.0
    for rank, copy in zip(ranks, copies):
        differs = ~torch.isclose(copy, reference, rtol=rtol, atol=atol)
        if differs.any():
            differing_ranks.append(rank)
            if copy.is_floating_point():
                difference = (copy.float() - reference.float()).abs().nan_to_num(nan=0.0)
                max_difference = max(max_difference, float(difference.max()))
        mismatch |= differs
    count = int(mismatch.sum())
    if not count:
        return None
    nans = int(sum(copy.isnan().sum() for copy in copies)) if reference.is_floating_point() else 0
    return Mismatch(
        count=count,
        elements=reference.numel(),
        ranks=tuple(differing_ranks),
        reference_rank=ranks[0],
        max_difference=max_difference,
        nans=nans,
    )


def _check_shapes(tensor: torch.Tensor, group: ProcessGroup, ranks: list[int]) -> None:
    if tensor.ndim > _MAX_DIMS:
        raise ValueError(f"cannot compare a tensor of {tensor.ndim} dims between ranks (at most {_MAX_DIMS})")
    shape = torch.full((_MAX_DIMS + 1,), -1, dtype=torch.int64, device=tensor.device)
    shape[0] = tensor.ndim
    shape[1 : tensor.ndim + 1] = torch.tensor(tensor.shape, dtype=torch.int64)
    shapes = [tuple(copy[1 : int(copy[0]) + 1].tolist()) for copy in all_gather_tensors(shape, group)]
    if len(set(shapes)) > 1:
        listed = ", ".join(f"rank {rank}: {list(shape)}" for rank, shape in zip(ranks, shapes))
        raise ParallelMismatchError(f"the ranks hold tensors of different shapes ({listed})")


def check_parallel_match(
    tensor: torch.Tensor,
    group: ProcessGroup | None,
    name: str,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    raise_on_mismatch: bool = False,
) -> int:
    """The number of elements of `tensor` that differ between the ranks of `group` or are NaN.

    Every rank must call it. Each rank's copy is compared with the copy of the group's first rank; any mismatch is
    logged (and raised with `raise_on_mismatch`), naming the tensor and the (global) ranks whose copy differs; copies
    of different shapes are always raised. A single process only counts NaNs.
    """
    try:
        mismatch = compare_across(tensor, group, atol=atol, rtol=rtol)
    except ParallelMismatchError as error:
        raise ParallelMismatchError(f"MISMATCH {name}: {error}") from None
    if mismatch is None:
        return 0
    message = f"MISMATCH {name}: {mismatch.describe()}"
    logger.warning(message)
    if raise_on_mismatch:
        raise ParallelMismatchError(message)
    return mismatch.count
