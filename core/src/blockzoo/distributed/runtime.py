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
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Distributed:
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
        if self.config.zero_stage == 0 and self.data_size > 1:
            # The same ranks with a data_shard dim of size one after the data dim: FSDP's replicate × shard mesh.
            with_shard = (*shape[:2], 1, *shape[2:])
            names = (*MESH_DIMS[:2], "data_shard", *MESH_DIMS[2:])
            self._replicated_data_mesh = init_device_mesh(self.device.type, with_shard, mesh_dim_names=names)

    def shutdown(self) -> None:
        """Destroy the process group if this object made it. Safe to call twice."""
        self.mesh = self._replicated_data_mesh = None
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
    def tensor_group(self) -> ProcessGroup | None:
        return self._group("tensor")

    @property
    def sequence_data_group(self) -> ProcessGroup | None:
        return self._group("sequence_data")

    @property
    def data_group(self) -> ProcessGroup | None:
        return self._group("data")

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
        if self._replicated_data_mesh is not None:
            return self._replicated_data_mesh["data", "data_shard"]
        return self.mesh["data"]

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
        """Sum over the tensor group the partial gradients of replicated parameters.

        Those are the parameters flagged `meta.reduce_gradient_over_tensor_group`: they saw only this rank's
        tokens (sequence-tensor-parallel) or only this rank's heads (a replicated layer inside the tensor
        region). Call after the backward pass of a tensor-parallel run, before the optimizer step. Under FSDP the
        gradients are this rank's shards of the data-parallel sum: the tensor ranks of one data coordinate hold the
        same rows of them, so their shards are summed (the two sums commute).
        """
        grads = [
            local_tensor(parameter.grad)
            for parameter in parameters
            if parameter.grad is not None and getattr(parameter, "meta", None) is not None
            if parameter.meta.reduce_gradient_over_tensor_group
        ]
        if not grads or self.tensor_size == 1:
            return
        # One collective for all of them: these are many small tensors (biases, norm weights).
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        dist.all_reduce(flat, group=self.tensor_group)
        for grad, reduced in zip(grads, flat.split([grad.numel() for grad in grads])):
            grad.copy_(reduced.view_as(grad))


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor`: the local shard of an FSDP (DTensor) parameter or gradient, else `tensor`."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _backend(backend: str) -> str:
    if backend != "auto":
        return backend
    return "nccl" if torch.cuda.is_available() else "gloo"
