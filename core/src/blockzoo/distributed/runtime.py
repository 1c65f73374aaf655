"""The distributed runtime: process group, device mesh and the groups the layers use.

`Distributed(config)` reads the launch from `torchrun`'s environment (WORLD_SIZE, RANK, LOCAL_RANK;
a single process when they are absent), checks that the layout divides the world, initializes the
default process group (unless one exists already, e.g. made by the caller) and lays the ranks out
on a `DeviceMesh` of named dims (pipeline, data, sequence_data, tensor), tensor-parallel fastest so
that tensor-parallel ranks share a node. A single process has no process group at all: every group
is None and every rank 0 (unless the caller made a process group of one, e.g. to run FSDP on one GPU:
then the mesh exists, all of size one). Use it as a context manager, or call `shutdown()`.

`data_parallel_mesh` is the mesh FSDP2 shards over (`blockzoo.distributed.data_parallel`): the data dim alone
for ZeRO 1-3; for ZeRO 0 a (data, data_shard) mesh whose shard dim has size one, so that FSDP replicates the
weights over the data ranks (HSDP without sharding) and all-reduces the gradients.

Sequence-data parallelism folds into it (as torchtitan folds context parallelism into FSDP's mesh): the
sequence-data ranks of one data rank hold slices of the same micro-batches, so the gradients of replicated weights
are summed over data × sequence_data, and ZeRO shards over both. Since the two dims are adjacent in the rank order,
a second mesh over the same ranks with one `data_sequence` dim of their product is that fold
(`data_sequence_group`).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from blockzoo.distributed.config import DistributedConfig
from blockzoo.errors import UsageError

MESH_DIMS = ("pipeline", "data", "sequence_data", "tensor")
# The same ranks with data and sequence_data folded into one dim (their gradients are summed together).
FOLDED_DIMS = ("pipeline", "data_sequence", "tensor")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Distributed:
    """The ranks and groups of a run (module docstring). What layers read:

    - `config` (the `DistributedConfig`), `device` (this rank's: `cuda:<local_rank>` on NCCL, else the CPU),
      `compute_dtype` (torch dtype of activations), `backend` (`gloo` or `nccl`);
    - `world_size`, `rank`, `local_rank`; per mesh dim a size, a rank and a group (None in a single process, and
      then every rank 0): `tensor_size` / `tensor_rank` / `tensor_group` (tensor parallelism: split weights),
      `sequence_data_size` / `sequence_data_rank` / `sequence_data_group` (slices of one sequence),
      `data_size` / `data_rank` / `data_group` (replicas, ZeRO shards), `pipeline_rank` / `pipeline_group`;
      `data_sequence_size` / `data_sequence_group` (data × sequence_data: where gradients are summed);
    - `sequence_tensor_parallel` (whether the residual stream is split along tokens over the tensor group);
    - `mesh` (the `DeviceMesh` of dims pipeline, data, sequence_data, tensor; None in a single process) and
      `data_parallel_mesh` (what FSDP2 shards over);
    - `reduce_replicated_gradients(parameters)`, `shutdown()` (also on leaving a `with` block)."""

    def __init__(
        self,
        config: DistributedConfig,
        *,
        world_size: int | None = None,
        rank: int | None = None,
        local_rank: int | None = None,
    ):
        """`world_size`, `rank` and `local_rank` override the environment (e.g. a single-process reference)."""
        self.config = config
        self.world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
        try:
            self.data_size = config.data_parallel(self.world_size)
        except ValueError as error:
            raise UsageError(
                f"cannot lay out {self.world_size} processes: {error} (distributed.tensor_parallel); "
                "start as many processes as the layout needs, e.g. `torchrun --nproc-per-node N -m blockzoo train ...`"
            ) from None
        self.backend = _backend(config.backend)
        self.device = torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")
        self.mesh: DeviceMesh | None = None
        self._replicated_data_mesh: DeviceMesh | None = None
        self._folded_mesh: DeviceMesh | None = None
        self._owns_process_group = False
        if self.world_size > 1 or (self.world_size == 1 and dist.is_initialized() and dist.get_world_size() == 1):
            self._start()

    def _start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if dist.is_initialized():
            if dist.get_world_size() != self.world_size:
                raise ValueError(
                    f"a process group of {dist.get_world_size()} ranks exists, but this run has {self.world_size}"
                )
        else:
            dist.init_process_group(
                self.backend,
                rank=self.rank,
                world_size=self.world_size,
                timeout=datetime.timedelta(seconds=self.config.timeout),
            )
            self._owns_process_group = True
        try:
            self._lay_out()
        except BaseException:
            self.shutdown()  # a group this object made does not outlive it
            raise

    def _lay_out(self) -> None:
        shape = (self.config.pipeline_parallel, self.data_size, self.config.sequence_data_parallel, self.tensor_size)
        self.mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=MESH_DIMS)
        dims, names = shape, MESH_DIMS
        if self.sequence_data_size > 1:
            dims, names = (shape[0], self.data_sequence_size, shape[3]), FOLDED_DIMS
            self._folded_mesh = init_device_mesh(self.device.type, dims, mesh_dim_names=names)
        if self.config.zero_stage == 0 and self.data_sequence_size > 1:
            # The same ranks with a data_shard dim of size one after the data dim: FSDP's replicate × shard mesh.
            with_shard = (*dims[:2], 1, *dims[2:])
            names = (*names[:2], "data_shard", *names[2:])
            self._replicated_data_mesh = init_device_mesh(self.device.type, with_shard, mesh_dim_names=names)

    def shutdown(self) -> None:
        """Destroy the process group if this object made it. Safe to call twice."""
        self.mesh = self._replicated_data_mesh = self._folded_mesh = None
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_process_group = False

    def __enter__(self) -> Distributed:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # -- layout --------------------------------------------------------------------------------------------------------

    @property
    def compute_dtype(self) -> torch.dtype:
        return _DTYPES[self.config.compute_dtype]

    @property
    def sequence_tensor_parallel(self) -> bool:
        return self.config.uses_sequence_tensor_parallel

    @property
    def tensor_size(self) -> int:
        return self.config.tensor_parallel

    @property
    def sequence_data_size(self) -> int:
        return self.config.sequence_data_parallel

    @property
    def data_sequence_size(self) -> int:
        """The data-parallel ranks times the sequence-data-parallel ranks: those over which gradients are summed."""
        return self.data_size * self.sequence_data_size

    @property
    def tensor_group(self) -> ProcessGroup | None:
        return self._group("tensor")

    @property
    def sequence_data_group(self) -> ProcessGroup | None:
        return self._group("sequence_data")

    @property
    def data_group(self) -> ProcessGroup | None:
        return self._group("data")

    @property
    def data_sequence_group(self) -> ProcessGroup | None:
        """The data and sequence-data ranks of this rank's tensor and pipeline coordinates together (the data group
        without sequence-data parallelism): the replicas of a gradient, and what the step's losses are summed over."""
        if self._folded_mesh is not None:
            return self._folded_mesh.get_group("data_sequence")
        return self.data_group

    @property
    def pipeline_group(self) -> ProcessGroup | None:
        return self._group("pipeline")

    @property
    def pipeline_rank(self) -> int:
        return self._rank("pipeline")

    @property
    def data_parallel_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP2 shards over (None in a single process): `data` for ZeRO 1-3, (`data`, `data_shard` of
        size one) for ZeRO 0, whose weights stay whole on every data rank."""
        if self.mesh is None:
            return None
        data = "data" if self._folded_mesh is None else "data_sequence"
        if self._replicated_data_mesh is not None:
            return self._replicated_data_mesh[data, "data_shard"]
        return self.mesh["data"] if self._folded_mesh is None else self._folded_mesh["data_sequence"]

    @property
    def tensor_rank(self) -> int:
        return self._rank("tensor")

    @property
    def sequence_data_rank(self) -> int:
        return self._rank("sequence_data")

    @property
    def data_rank(self) -> int:
        return self._rank("data")

    def _group(self, dim: str) -> ProcessGroup | None:
        return None if self.mesh is None else self.mesh.get_group(dim)

    def _rank(self, dim: str) -> int:
        return 0 if self.mesh is None else self.mesh.get_local_rank(dim)

    # -- gradients -----------------------------------------------------------------------------------------------------

    def reduce_replicated_gradients(self, parameters: Iterable[nn.Parameter]) -> None:
        """Sum the partial gradients of replicated parameters over the groups whose ranks saw other tokens.

        Over the tensor group, the parameters flagged `meta.reduce_gradient_over_tensor_group`: they saw only this
        rank's tokens (sequence-tensor-parallel) or only this rank's heads (a replicated layer inside the tensor
        region). Under FSDP the gradients are this rank's shards of the data-parallel sum: the tensor ranks of one
        data coordinate hold the same rows of them, so their shards are summed (the two sums commute). Over the
        sequence-data group, the parameters split over the data ranks (`meta.data_parallel_sharded`: experts),
        which FSDP leaves alone: each holds the tokens of every data rank's slice at this sequence-data rank.
        Call after the backward pass, before the optimizer step.
        """
        parameters = [
            parameter
            for parameter in parameters
            if parameter.grad is not None and getattr(parameter, "meta", None) is not None
        ]
        if self.tensor_size > 1:
            _all_reduce_together(
                [local_tensor(p.grad) for p in parameters if p.meta.reduce_gradient_over_tensor_group],
                self.tensor_group,
            )
        if self.sequence_data_size > 1:
            _all_reduce_together(
                [local_tensor(p.grad) for p in parameters if p.meta.data_parallel_sharded], self.sequence_data_group
            )


def _all_reduce_together(grads: list[torch.Tensor], group: ProcessGroup) -> None:
    """Sum `grads` over `group` in place, in one collective: these are many small tensors (biases, norm weights)."""
    if not grads:
        return
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    dist.all_reduce(flat, group=group)
    for grad, reduced in zip(grads, flat.split([grad.numel() for grad in grads])):
        grad.copy_(reduced.view_as(grad))


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor`: the local shard of an FSDP (DTensor) parameter or gradient, else `tensor`."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _backend(backend: str) -> str:
    if backend != "auto":
        return backend
    return "nccl" if torch.cuda.is_available() else "gloo"
