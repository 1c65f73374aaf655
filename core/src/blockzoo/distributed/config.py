"""How a run is spread over processes. Torch-free; the runtime is `blockzoo.distributed.runtime`."""

from __future__ import annotations

import itertools
from typing import Literal

from blockzoo.config import Config, ConfigFieldError, check, configclass, field, greater_than


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
    sequence_data_parallel: int = field(
        1,
        doc="Ranks that split each micro-batch's tokens (micro_batch_size × sequence_length, a multiple of it) into "
        "consecutive slices, one per rank; packed documents cross the slices' boundaries freely. Every layer must "
        "declare the sequence_data_parallel capability. The ranks of one data-parallel rank read the same "
        "micro-batches; replicated gradients are summed over them as over the data ranks (ZeRO shards over both).",
        validator=greater_than(0),
    )
    micro_sequence_length: int | None = field(
        None,
        doc="Run each rank's share of a micro-batch in chunks of this many tokens, one after the other, the "
        "mixers' state (keys and values, SSM states) carried from chunk to chunk and gradients flowing back through "
        "it: the same step, whose layers see at most this many tokens at a time. Lowers the peak activation memory "
        "most with recomputation (training.recompute), which then redoes one chunk of one block at a time. Under "
        "sequence_data_parallel the ranks run one chunk each at a time: step c covers the c-th "
        "sequence_data_parallel × micro_sequence_length tokens. Must divide micro_batch_size × sequence_length / "
        "sequence_data_parallel. None: the whole share at once.",
        validator=greater_than(0),
    )
    zero_stage: Literal[0, 1, 2, 3] = field(
        0,
        doc="Sharding over the data-parallel ranks (ZeRO, through PyTorch's FSDP2 over the mesh's data dim). "
        "0: weights, gradients and optimizer state replicated; the gradients summed over the data ranks after the "
        "step's last micro-batch, block by block while the backward pass runs. 1: the optimizer state (and the "
        "weights between steps) sharded; the gradients accumulate whole over the step's micro-batches and are "
        "reduce-scattered once. 2: also the gradients sharded, reduce-scattered after every micro-batch. 3: also the "
        "weights sharded during the step, each block's gathered just before it runs and freed after. Experts of "
        "expert parallelism stay split over the data ranks, never sharded again.",
    )
    pipeline_parallel: int = field(
        1,
        doc="Ranks that split the block sequence into pipeline stages. Every optimizer step runs "
        "`training.gradient_accumulation` micro-batches through the pipeline (its micro-batches per step).",
        validator=greater_than(0),
    )
    pipeline_schedule: Literal["1f1b", "interleaved"] = field(
        "1f1b",
        doc="`1f1b`: one stage per pipeline rank, one forward and one backward in turn once the pipeline is full; "
        "needs at least `pipeline_parallel` micro-batches per step. `interleaved`: "
        "`pipeline_stages_per_rank` stages per rank, stage s on pipeline rank s % pipeline_parallel (a smaller "
        "bubble for more communication); its micro-batches per step must be at least `pipeline_parallel` and a "
        "multiple of their rounds (micro-batches // pipeline_parallel).",
    )
    pipeline_stages_per_rank: int = field(
        1,
        doc="Stages each pipeline rank holds: 1 with `1f1b`, 2 or more with `interleaved`.",
        validator=greater_than(0),
    )
    pipeline_split: list[int] | None = field(
        None,
        doc="The block indices where stages 1, 2, ... begin (stage 0 begins at block 0), increasing: one fewer than "
        "the stages (pipeline_parallel × pipeline_stages_per_rank); every stage holds at least one block, and a "
        "pattern may be split anywhere. None: balanced by block count; the blocks that do not divide evenly go one "
        "each to the middle stages, then to the first; never to the last stage, which also holds the head and the "
        "loss (the first holds the embeddings, a lookup).",
    )
    compute_dtype: Literal["fp32", "bf16"] = field(
        "fp32", doc="Dtype of the forward and backward passes (master weights stay fp32)."
    )
    seed: int = field(1234, doc="Seed of initialization, data sampling and dropout.")
    timeout: float = field(600.0, doc="Seconds a collective may wait before the run fails.", validator=greater_than(0))
    backend: Literal["auto", "nccl", "gloo"] = field("auto", doc="auto: nccl with CUDA, else gloo.")
    debug: bool = field(
        False,
        doc=(
            "Check that the tensor-parallel ranks agree, slowly (a collective or two per checked tensor: for finding "
            "bugs, not for training): every activation that should be the same on all of them (forward) and the "
            "gradient flowing through it (backward), in execution order, the first difference stopping the run "
            "with the module's path, the direction, the ranks and the difference; after each optimizer step, every "
            "parameter (and gradient) that should be replicated over the tensor or data group."
        ),
    )

    def __attrs_post_init__(self) -> None:
        if self.pipeline_schedule == "1f1b":
            check(
                self.pipeline_stages_per_rank == 1,
                "pipeline_stages_per_rank",
                f"the 1f1b schedule runs one stage per rank, got {self.pipeline_stages_per_rank}; use "
                "pipeline_schedule: interleaved for more",
            )
        else:
            check(
                self.pipeline_stages_per_rank >= 2,
                "pipeline_stages_per_rank",
                "the interleaved schedule runs 2 or more stages per rank; use pipeline_schedule: 1f1b for one",
            )
            check(self.pipeline_parallel > 1, "pipeline_schedule", "interleaved needs pipeline_parallel > 1")
        if self.pipeline_split is not None:
            check(self.pipeline_parallel > 1, "pipeline_split", "needs pipeline_parallel > 1")
            check(
                len(self.pipeline_split) == self.pipeline_stages - 1,
                "pipeline_split",
                f"{self.pipeline_stages} stages begin at {self.pipeline_stages - 1} block indices after block 0 "
                f"(pipeline_parallel × pipeline_stages_per_rank - 1), got {len(self.pipeline_split)}",
            )
            starts = [0, *self.pipeline_split]
            for index, (previous, start) in enumerate(itertools.pairwise(starts)):
                check(
                    start > previous,
                    f"pipeline_split.{index}",
                    f"stage {index + 1} must begin after block {previous} (every stage holds a block), got {start}",
                )

    @property
    def model_parallel(self) -> int:
        return self.tensor_parallel * self.sequence_data_parallel * self.pipeline_parallel

    @property
    def pipeline_stages(self) -> int:
        """Stages of the whole pipeline."""
        return self.pipeline_parallel * self.pipeline_stages_per_rank

    def stage_blocks(self, num_blocks: int) -> list[range]:
        """The blocks of each pipeline stage, in order (see `pipeline_split`)."""
        stages = self.pipeline_stages
        if self.pipeline_split is not None:
            starts = [0, *self.pipeline_split, num_blocks]
        else:
            size, remainder = divmod(num_blocks, stages)
            sizes = [size] * stages
            for stage in [*range(1, stages - 1), 0][:remainder]:  # the middle stages first, then the first
                sizes[stage] += 1
            starts = [0, *itertools.accumulate(sizes)]
        return [range(start, end) for start, end in itertools.pairwise(starts)]

    def check_pipeline(self, num_blocks: int, micro_batches: int) -> None:
        """Refuse a pipeline the model's `num_blocks` or the step's `micro_batches` cannot fill (a
        `ConfigFieldError` naming the field, relative to the run config)."""
        if self.pipeline_parallel == 1:
            return
        stages = self.pipeline_stages
        if self.pipeline_split is None:
            check(
                num_blocks >= stages,
                "distributed.pipeline_parallel",
                f"{stages} pipeline stages need at least {stages} blocks, the model has {num_blocks}",
            )
        elif self.pipeline_split[-1] >= num_blocks:
            raise ConfigFieldError(
                f"distributed.pipeline_split.{stages - 2}",
                f"stage {stages - 1} begins at block {self.pipeline_split[-1]}, beyond the model's {num_blocks} blocks",
            )
        check(
            micro_batches >= self.pipeline_parallel,
            "training.gradient_accumulation",
            f"the pipeline's micro-batches per step: {micro_batches} cannot fill {self.pipeline_parallel} pipeline "
            f"ranks; give at least {self.pipeline_parallel}",
        )
        rounds = max(1, micro_batches // self.pipeline_parallel)
        check(
            self.pipeline_schedule != "interleaved" or micro_batches % rounds == 0,
            "training.gradient_accumulation",
            f"the interleaved schedule runs its {micro_batches} micro-batches per step in rounds of "
            f"{micro_batches // rounds} ({rounds} rounds); give a multiple of {rounds}",
        )

    @property
    def uses_slices(self) -> bool:
        """Whether the layers run over slices of sequences (sequence-data parallelism or micro-sequences)."""
        return self.sequence_data_parallel > 1 or self.micro_sequence_length is not None

    def check_micro_batch_tokens(self, tokens: int) -> None:
        """Refuse a micro-batch of `tokens` tokens the slices cannot split evenly (a `ConfigFieldError` naming the
        field, relative to the run config)."""
        share, remainder = divmod(tokens, self.sequence_data_parallel)
        check(
            remainder == 0,
            "data.micro_batch_size",
            f"a micro-batch of micro_batch_size × sequence_length = {tokens} tokens cannot be split between "
            f"{self.sequence_data_parallel} sequence-data-parallel ranks (distributed.sequence_data_parallel): "
            "make it a multiple",
        )
        if self.micro_sequence_length is not None:
            check(
                share % self.micro_sequence_length == 0,
                "distributed.micro_sequence_length",
                f"{self.micro_sequence_length} does not divide each sequence-data rank's share of a micro-batch, "
                f"{share} tokens (data.micro_batch_size × data.sequence_length / distributed.sequence_data_parallel)",
            )
        if self.uses_sequence_tensor_parallel:
            piece = share if self.micro_sequence_length is None else self.micro_sequence_length
            check(
                piece % self.tensor_parallel == 0,
                "distributed.sequence_tensor_parallel",
                f"each slice of {piece} tokens is split again between the {self.tensor_parallel} tensor-parallel "
                "ranks: make the slices a multiple of tensor_parallel",
            )

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
