"""Filling a model's parameters from checkpoint tensors, each read once (docs/architecture.md "Loading").

The tensors come as views of the memory-mapped files (`SafetensorsReader.mapped`). A parameter whose local tensor
is the whole file tensor as it is (this process holds it whole, on the CPU, in the file's dtype) becomes that view:
no copy, the bytes are read from the page cache when first used, as transformers does. Otherwise this rank's part
(its tensor-parallel shard, its FSDP rows) of the view is copied into the parameter, cast on the way: one pass over
the bytes. A parameter made of several file tensors laid end to end (key‖value, gate‖up) is a view too when the
file holds them that way, else each part is copied into its slice of the parameter.

A model built `uninitialized()` has parameters allocated but never written (no page touched), so a parameter that
becomes a view costs no memory of its own; the view's pages are private (copy-on-write): training a loaded model
never writes to its checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from blockzoo.distributed.data_parallel import shard_like
from blockzoo.distributed.runtime import Distributed, local_tensor


def _split(parameter: nn.Parameter, distributed: Distributed) -> bool:
    """Whether this rank holds a part of the parameter's global tensor only: a tensor-parallel shard, some of the
    experts (split over the data ranks), or FSDP's rows."""
    if type(parameter.data) is not torch.Tensor:  # an FSDP DTensor
        return True
    meta = getattr(parameter, "meta", None)
    return meta is not None and (
        distributed.tensor_size > 1 or (distributed.data_size > 1 and bool(meta.data_parallel_dims))
    )


def _local_part(parameter: nn.Parameter, tensor: torch.Tensor, distributed: Distributed) -> torch.Tensor:
    """This rank's tensor-parallel (and expert) part of a global tensor shaped like `parameter`, before FSDP's rows."""
    meta = getattr(parameter, "meta", None)
    if meta is None or not _split(parameter, distributed):
        return tensor
    return meta.global_to_local(
        tensor, distributed.tensor_rank, distributed.tensor_size, distributed.data_rank, distributed.data_size
    )


def _adoptable(parameter: nn.Parameter, tensor: torch.Tensor) -> bool:
    """Whether `parameter` can take `tensor` as its data instead of a copy of it."""
    return (
        parameter.device == tensor.device
        and parameter.dtype == tensor.dtype
        and parameter.shape == tensor.shape
        and tensor.is_contiguous()
    )


@torch.no_grad()
def fill_parameter(parameter: nn.Parameter, tensor: torch.Tensor, distributed: Distributed, *, adopt: bool) -> None:
    """Put this rank's part of the global `tensor` into `parameter`. With `adopt` (`tensor` is a view of a mapped
    file, or a new tensor, that nothing else uses) and a parameter held whole here, as `tensor` is: the parameter
    becomes `tensor`; else a copy (cast to the parameter's dtype)."""
    if adopt and not _split(parameter, distributed) and _adoptable(parameter, tensor):
        parameter.data = tensor
        return
    local = _local_part(parameter, tensor, distributed)
    local_tensor(parameter).copy_(local_tensor(shard_like(parameter, local)))


@torch.no_grad()
def fill_concatenated(
    parameter: nn.Parameter,
    parts: Sequence[torch.Tensor],
    distributed: Distributed,
    *,
    transposed: bool = False,
    run: torch.Tensor | None = None,
) -> None:
    """Put this rank's part of the global tensor that is `parts` laid end to end along dim 0 (each transposed
    first with `transposed`) into `parameter`. `run`: the same as one mapped view, when the file holds the parts
    that way (the parameter may become it); else, for a parameter held whole here, each part is copied into its
    rows of the parameter, and otherwise the global tensor is put together first (one at a time)."""
    if run is not None:
        fill_parameter(parameter, run, distributed, adopt=True)
        return
    parts = [part.t() if transposed else part for part in parts]
    if _split(parameter, distributed):
        fill_parameter(parameter, torch.cat(parts), distributed, adopt=True)
        return
    start = 0
    for part in parts:
        parameter.data[start : start + len(part)].copy_(part)
        start += len(part)
    if start != len(parameter):
        raise ValueError(f"concatenated parts of {start} rows for a parameter of {len(parameter)}")
