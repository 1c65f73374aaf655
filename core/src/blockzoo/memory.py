"""The memory a training run's model state takes per rank, estimated from its parameter count and layout (`blockzoo
config`, `blockzoo init PRESET`). Torch-free.

What training keeps per parameter: the fp32 weight (4 bytes), its fp32 gradient (4) and AdamW's two fp32 moments
(8), 16 bytes in all. Tensor and pipeline parallelism split all three over their ranks (evenly, as an estimate: the
embeddings and the head sit on the first and last stages); ZeRO splits them over the data-parallel ranks: stage 1
the optimizer state, 2 also the gradients, 3 also the weights. Activations, the batches and the allocator's slack
come on top (they depend on the sequence length and micro-batch size, and on recomputation), so this is a floor.
"""

from __future__ import annotations

import attrs

WEIGHT_BYTES = 4
GRADIENT_BYTES = 4
OPTIMIZER_BYTES = 8  # AdamW: two fp32 moments


@attrs.frozen
class RankMemory:
    """Bytes of one rank's weights, gradients and optimizer state."""

    weights: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer

    def describe(self) -> str:
        return (
            f"{gib(self.total)} per rank for the model's training state ({gib(self.weights)} weights, "
            f"{gib(self.gradients)} gradients, {gib(self.optimizer)} AdamW state; activations come on top)"
        )


def per_rank(parameters: int, *, model_parallel: int = 1, data_parallel: int = 1, zero_stage: int = 0) -> RankMemory:
    """The training state of a model of `parameters` on one rank of a layout: `model_parallel` = tensor × pipeline
    ranks, `data_parallel` ranks sharding under `zero_stage`."""
    local = parameters / model_parallel

    def sharded(bytes_per_parameter: int, from_stage: int) -> float:
        share = data_parallel if zero_stage >= from_stage else 1
        return local * bytes_per_parameter / share

    return RankMemory(
        weights=sharded(WEIGHT_BYTES, 3), gradients=sharded(GRADIENT_BYTES, 2), optimizer=sharded(OPTIMIZER_BYTES, 1)
    )


def for_layout(parameters: int, distributed, processes: int) -> RankMemory:
    """`per_rank` for a `DistributedConfig` run over `processes` processes."""
    return per_rank(
        parameters,
        model_parallel=distributed.tensor_parallel * distributed.pipeline_parallel,
        data_parallel=distributed.data_parallel(processes),
        zero_stage=distributed.zero_stage,
    )


def gib(size: float) -> str:
    return f"{size / 2**30:,.1f} GiB"
