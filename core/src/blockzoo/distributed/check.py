"""Debug aid: do the ranks of a group hold the same copy of a tensor that should be replicated?"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from blockzoo.distributed.ops import all_gather_tensors

logger = logging.getLogger(__name__)


class ParallelMismatchError(RuntimeError):
    """A tensor that should be replicated differs between ranks."""


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

    Every rank must call it with a tensor of the same shape. Each rank's copy is compared with the
    copy of the group's first rank; any mismatch is logged (and raised with `raise_on_mismatch`),
    naming the tensor and the (global) ranks whose copy differs. A single process only counts NaNs.
    """
    copies = [tensor.detach()] if group is None else all_gather_tensors(tensor, group)
    ranks = [0] if group is None else dist.get_process_group_ranks(group)
    reference = copies[0]
    mismatch = torch.zeros(reference.shape, dtype=torch.bool, device=reference.device)
    differing_ranks = []
    for rank, copy in zip(ranks, copies):
        # NaN never equals NaN: a NaN anywhere counts as a mismatch.
        differs = ~torch.isclose(copy, reference, rtol=rtol, atol=atol)
        if differs.any():
            differing_ranks.append(rank)
        mismatch |= differs
    count = int(mismatch.sum())
    if count:
        nans = int(sum(copy.isnan().sum() for copy in copies)) if reference.is_floating_point() else 0
        message = (
            f"MISMATCH {name}: {count} of {reference.numel()} elements differ between ranks or are NaN "
            f"(ranks {differing_ranks} differ from rank {ranks[0]}; {nans} NaNs over all copies)"
        )
        logger.warning(message)
        if raise_on_mismatch:
            raise ParallelMismatchError(message)
    return count
