"""How a run is spread over processes. Torch-free; the runtime is `blockzoo.distributed.runtime`."""

from __future__ import annotations

from typing import Literal

from blockzoo.config import Config, check, configclass, field, greater_than


@configclass
class DistributedConfig(Config):
    """Parallel layout and numerics of a run.

    The world size comes from `torchrun` (WORLD_SIZE, RANK, LOCAL_RANK); the data-parallel size is
    what remains of it: `world_size // (tensor_parallel * sequence_data_parallel * pipeline_parallel)`.
    Ranks are ordered tensor-parallel fastest, then sequence-data-parallel, then data, then pipeline.
    """

    tensor_parallel: int = field(1, doc="Ranks that split each layer's weights.", validator=greater_than(0))
    sequence_tensor_parallel: bool = field(
        False, doc="Also split activations along tokens between tensor-parallel ranks (no effect without TP)."
    )
    sequence_data_parallel: int = field(1, doc="Ranks that split each sequence's tokens.", validator=greater_than(0))
    pipeline_parallel: int = field(1, doc="Pipeline stages.", validator=greater_than(0))
    compute_dtype: Literal["fp32", "bf16"] = field(
        "fp32", doc="Dtype of the forward and backward passes (master weights stay fp32)."
    )
    seed: int = field(1234, doc="Seed of initialization, data sampling and dropout.")
    timeout: float = field(600.0, doc="Seconds a collective may wait before the run fails.", validator=greater_than(0))
    backend: Literal["auto", "nccl", "gloo"] = field("auto", doc="auto: nccl with CUDA, else gloo.")

    def __attrs_post_init__(self) -> None:
        check(self.pipeline_parallel == 1, "pipeline_parallel", "pipeline parallelism is not implemented yet; use 1")
        check(
            self.sequence_data_parallel == 1,
            "sequence_data_parallel",
            "sequence-data parallelism is not implemented yet; use 1",
        )

    @property
    def model_parallel(self) -> int:
        return self.tensor_parallel * self.sequence_data_parallel * self.pipeline_parallel

    @property
    def uses_sequence_tensor_parallel(self) -> bool:
        return self.sequence_tensor_parallel and self.tensor_parallel > 1

    def data_parallel(self, world_size: int) -> int:
        if world_size % self.model_parallel:
            raise ValueError(
                f"world size {world_size} is not a multiple of tensor_parallel × sequence_data_parallel × "
                f"pipeline_parallel = {self.model_parallel}"
            )
        return world_size // self.model_parallel
