"""Tensor dimensions that know how they are split between tensor-parallel ranks.

A dim is layout-independent: it holds its global size and whether it is split ("parallel"); the
tensor-parallel rank and size are given when a local size or shard is asked for. Four kinds:

- `TensorDim`: a plain dim, split into contiguous equal chunks when parallel.
- `CompositeTensorDim`: a product of dims (heads × head_size) laid out component-major; at most one
  component is split, and the composite is split through it.
- `ConcatenatedTensorDim`: dims laid end to end (key‖value, gate‖up, Mamba's in_proj [z, x, B, C, dt]).
  A rank holds the concatenation of each component's local shard ([k_r, v_r]) while the global layout
  is the concatenation of the global components ([k, v]), so checkpoints do not depend on the layout.
- `PaddedTensorDim`: a dim the tensor-parallel size need not divide (the vocabulary): each rank holds
  ceil(size / tp) entries, the last ones padding; the global tensor keeps the true size.

Every dim maps a global tensor to a rank's shard (`global_to_local`) and back, either from every
rank's shard (`merge_shards`) or with an all-gather over the tensor group (`local_to_global`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup


class TensorDim:
    """One dimension of a parameter or activation: `name`, `global_size` (the size in one process and in
    checkpoints) and whether tensor parallelism splits it (`parallel`: into `local_size(tp)` contiguous entries per
    rank, rank r holding [r·local, (r+1)·local)). `global_to_local`, `merge_shards` and `local_to_global` map
    between a global tensor and the ranks' shards."""

    def __init__(self, name: str, global_size: int, parallel: bool = False):
        if global_size < 0:
            raise ValueError(f"tensor dim {name!r} has a negative size {global_size}")
        self.name = name
        self.global_size = global_size
        self.parallel = parallel

    def __repr__(self) -> str:
        split = ", parallel" if self.parallel else ""
        return f"{type(self).__name__}({self.name!r}, {self.global_size}{split})"

    def local_size(self, tp_size: int) -> int:
        """The size a tensor-parallel rank holds."""
        if not self.parallel:
            return self.global_size
        if self.global_size % tp_size:
            raise ValueError(
                f"tensor dim {self.name!r} of size {self.global_size} cannot be split evenly between "
                f"{tp_size} tensor-parallel ranks"
            )
        return self.global_size // tp_size

    def global_to_local(self, tensor: torch.Tensor, dim_index: int, tp_rank: int, tp_size: int) -> torch.Tensor:
        """The shard of dimension `dim_index` of a global tensor that tensor-parallel rank `tp_rank` holds."""
        if not self.parallel:
            return tensor
        size = self.local_size(tp_size)
        return tensor.narrow(dim_index, tp_rank * size, size)

    def merge_shards(self, shards: Sequence[torch.Tensor], dim_index: int) -> torch.Tensor:
        """The global tensor from every tensor-parallel rank's shard, in rank order (inverse of `global_to_local`)."""
        if not self.parallel:
            return shards[0]
        import torch

        return torch.cat(list(shards), dim_index)

    def local_to_global(self, tensor: torch.Tensor, dim_index: int, group: ProcessGroup | None) -> torch.Tensor:
        """The global tensor, all-gathered over the tensor-parallel `group` (None: a single process)."""
        if not self.parallel or group is None or group.size() == 1:
            return tensor
        from blockzoo.distributed.ops import all_gather_tensors

        return self.merge_shards(all_gather_tensors(tensor, group), dim_index)


class CompositeTensorDim(TensorDim):
    """The product of `dims`, laid out with the first component outermost (e.g. heads × head_size)."""

    def __init__(self, name: str, dims: Sequence[TensorDim]):
        split = [dim.name for dim in dims if dim.parallel]
        if len(split) > 1:
            raise ValueError(f"composite tensor dim {name!r}: only one component may be split, got {split}")
        super().__init__(name, math.prod(dim.global_size for dim in dims), bool(split))
        self.dims = tuple(dims)

    def local_size(self, tp_size: int) -> int:
        return math.prod(dim.local_size(tp_size) for dim in self.dims)

    def global_to_local(self, tensor: torch.Tensor, dim_index: int, tp_rank: int, tp_size: int) -> torch.Tensor:
        if not self.parallel:
            return tensor
        # View the dim as its components, shard the split one, and flatten back.
        tensor = tensor.unflatten(dim_index, [dim.global_size for dim in self.dims])
        for offset, dim in enumerate(self.dims):
            tensor = dim.global_to_local(tensor, dim_index + offset, tp_rank, tp_size)
        return tensor.flatten(dim_index, dim_index + len(self.dims) - 1)

    def merge_shards(self, shards: Sequence[torch.Tensor], dim_index: int) -> torch.Tensor:
        if not self.parallel:
            return shards[0]
        local_sizes = [dim.local_size(len(shards)) for dim in self.dims]
        shards = [shard.unflatten(dim_index, local_sizes) for shard in shards]
        offset, split_dim = next((offset, dim) for offset, dim in enumerate(self.dims) if dim.parallel)
        merged = split_dim.merge_shards(shards, dim_index + offset)
        return merged.flatten(dim_index, dim_index + len(self.dims) - 1)


class ConcatenatedTensorDim(TensorDim):
    """`dims` laid end to end; each component is sharded on its own (key‖value, gate‖up, ...)."""

    def __init__(self, name: str, dims: Sequence[TensorDim]):
        if len({dim.parallel for dim in dims}) > 1:
            split = [dim.name for dim in dims if dim.parallel]
            replicated = [dim.name for dim in dims if not dim.parallel]
            raise ValueError(
                f"concatenated tensor dim {name!r}: components must be all split or all replicated, "
                f"got split {split} and replicated {replicated}"
            )
        super().__init__(name, sum(dim.global_size for dim in dims), any(dim.parallel for dim in dims))
        self.dims = tuple(dims)

    def local_size(self, tp_size: int) -> int:
        return sum(dim.local_size(tp_size) for dim in self.dims)

    def component_slices(self, tp_size: int = 1) -> list[slice]:
        """Where each component lies in a rank's local layout (the global layout for `tp_size` 1)."""
        slices, start = [], 0
        for dim in self.dims:
            size = dim.local_size(tp_size)
            slices.append(slice(start, start + size))
            start += size
        return slices

    def global_to_local(self, tensor: torch.Tensor, dim_index: int, tp_rank: int, tp_size: int) -> torch.Tensor:
        if not self.parallel:
            return tensor
        import torch

        components = tensor.split([dim.global_size for dim in self.dims], dim_index)
        return torch.cat(
            [dim.global_to_local(part, dim_index, tp_rank, tp_size) for dim, part in zip(self.dims, components)],
            dim_index,
        )

    def merge_shards(self, shards: Sequence[torch.Tensor], dim_index: int) -> torch.Tensor:
        if not self.parallel:
            return shards[0]
        import torch

        local_sizes = [dim.local_size(len(shards)) for dim in self.dims]
        per_rank = [shard.split(local_sizes, dim_index) for shard in shards]
        return torch.cat(
            [dim.merge_shards([parts[index] for parts in per_rank], dim_index) for index, dim in enumerate(self.dims)],
            dim_index,
        )


class PaddedTensorDim(TensorDim):
    """A dim split into chunks of ceil(global_size / tp) entries, the global tensor zero-padded to a multiple of the
    tensor-parallel size before sharding and truncated after gathering (the vocabulary: 257 ids over 2 ranks are 129
    rows each, the last one padding). `global_size` is the true size, so checkpoints hold the unpadded tensor and
    any layout loads any other. Padded entries are zeros; the layers that use them make sure they stay so."""

    def local_size(self, tp_size: int) -> int:
        if not self.parallel:
            return self.global_size
        return -(-self.global_size // tp_size)

    def padded_size(self, tp_size: int) -> int:
        """The global size padded to a multiple of the tensor-parallel size."""
        return self.local_size(tp_size) * (tp_size if self.parallel else 1)

    def valid_size(self, tp_rank: int, tp_size: int) -> int:
        """How many of rank `tp_rank`'s entries are real (the others are padding)."""
        size = self.local_size(tp_size)
        return max(0, min(size, self.global_size - tp_rank * size)) if self.parallel else self.global_size

    def global_to_local(self, tensor: torch.Tensor, dim_index: int, tp_rank: int, tp_size: int) -> torch.Tensor:
        if not self.parallel:
            return tensor
        size = self.local_size(tp_size)
        start, valid = tp_rank * size, self.valid_size(tp_rank, tp_size)
        shard = tensor.narrow(dim_index, min(start, self.global_size), valid)
        if valid == size:
            return shard
        import torch

        shape = list(tensor.shape)
        shape[dim_index] = size - valid
        return torch.cat([shard, tensor.new_zeros(shape)], dim_index)

    def merge_shards(self, shards: Sequence[torch.Tensor], dim_index: int) -> torch.Tensor:
        if not self.parallel:
            return shards[0]
        import torch

        return torch.cat(list(shards), dim_index).narrow(dim_index, 0, self.global_size)
