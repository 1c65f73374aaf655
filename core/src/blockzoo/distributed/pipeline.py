"""Pipeline parallelism: the block sequence split into stages run by `torch.distributed.pipelining`.

The stages are made of the model's own parts: the first holds the embeddings, every stage a contiguous range of
blocks (`DistributedConfig.stage_blocks`: `pipeline_split`, or balanced), the last the head and the loss. A pipeline
rank builds the whole model on the meta device, keeps its stages' parts and allocates only those
(`build_pipeline_model`): the other parts become `RemotePart`s, which hold no parameters but still report their
FLOPs. Parameter names stay those of the whole model, so checkpoints hold global tensors keyed as always.

`Pipeline` runs a step's micro-batches through torch's schedules (`Schedule1F1B`, or `ScheduleInterleaved1F1B` with
stage s on pipeline rank s % pipeline_parallel), composed with our tensor, sequence-tensor and expert parallelism
inside each stage, and with sequence-data parallelism (each rank's stages run its slice of every micro-batch, the
mixers exchanging over the sequence-data group; micro-sequences are refused). Only tensors travel between stages: the
hidden states `[tokens, hidden]` (this rank's token slice under sequence-tensor-parallel), and, to every stage, the
micro-batch's index (a keyword argument), by which a stage finds the micro-batch's `Batch` (document lengths,
positions: every pipeline rank reads the same micro-batches) and labels. Micro-batch shapes are static: every
micro-batch has micro_batch_size × sequence_length tokens (over sequence_data_parallel, per slice). Building a
pipeline rank's part of the model is `pipeline_model.py`.

The loss is computed on the last stage: the cross-entropy summed over labelled tokens over the step's divisor (the
labelled tokens of the step on all data ranks), plus the named losses of its layers (MoE router losses) over theirs
(the step's micro-batches on all data ranks), as the trainer computes it without a pipeline. The named losses of the
other stages reach the backward pass through their stage's output: `attach_losses` returns the hidden states
unchanged and, in the backward pass, gives each loss the gradient one over its divisor (the trick Megatron uses for
MoE auxiliary losses). Their values, and the cross-entropy, are summed over the pipeline ranks after the
step, so every rank logs the same figures.

Tied embedding and output weights: the first stage holds the embedding table, the last stage a copy of it as its
output weight (`TIED_COPY`, under the embedding's name). After the backward pass their gradients are summed over
the process group of the pipeline ranks holding stages 0 and S-1 (one group per data/tensor coordinate), so both
copies take the same update; the gradient norm and the checkpoint count the first stage's only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)

from blockzoo.distributed.pipeline_model import TIED_COPY, TiedCopy, local_stages
from blockzoo.distributed.pipeline_model import build_pipeline_model as build_pipeline_model  # (importable here too)
from blockzoo.distributed.runtime import Distributed, local_tensor
from blockzoo.layers.base import Batch, slice_losses
from blockzoo.model.language_model import LanguageModel, own_tokens

# -- the stages --------------------------------------------------------------------------------------------------------


class StageModule(nn.Module):
    """One pipeline stage made of the model's parts: (the embeddings,) its blocks (, the head and the loss).

    Called as `stage(inputs, micro_batch=index)`: `inputs` are the micro-batch's tokens on the first stage, the
    previous stage's hidden states on the others; `index` (a CPU tensor of one element) names the micro-batch.
    Returns the hidden states, or on the last stage the micro-batch's loss as the step weighs it (shape [1]).
    """

    def __init__(self, model: LanguageModel, stage: int, blocks: range, num_stages: int, step: _StepState):
        super().__init__()
        self.stage = stage
        self.embeddings = model.embeddings if stage == 0 else None
        self.blocks = nn.ModuleDict({str(index): model.decoder[index] for index in blocks})
        self.head = model.head if stage == num_stages - 1 else None
        # The last stage's copy of a tied table is in its module tree too, so that a wrapper replacing the head's
        # weight (FSDP) replaces it under the embedding's name as well.
        tied_copy = self.head is not None and isinstance(model.embeddings, TiedCopy)
        self.tied_copy = model.embeddings if tied_copy else None
        self._step = step

    def forward(self, inputs: torch.Tensor, micro_batch: torch.Tensor) -> torch.Tensor:
        step = self._step
        index = int(micro_batch)  # a CPU tensor: no device synchronization
        batch, labels = step.micro_batches[index].batch, step.micro_batches[index].labels
        hidden = inputs if self.embeddings is None else self.embeddings(inputs, batch)
        known = {*batch.losses, *batch.statistics}
        for block in self.blocks.values():
            if batch.is_slice:  # this rank's slice of the micro-batch (sequence-data parallelism)
                hidden, _ = block.forward_slice(hidden, batch, None)
            else:
                hidden = block(hidden, batch)
        if batch.is_slice:  # this stage's named losses of the whole micro-batch
            losses = slice_losses([batch], [name for name in [*batch.losses, *batch.statistics] if name not in known])
        else:
            losses = {name: value for name, value in batch.losses.items() if name not in known}
        step.record_named_losses(losses)
        if self.head is None:
            return attach_losses(hidden, list(losses.values()), step.named_loss_divisor)
        if step.rows is not None:  # inference (`Pipeline.logits`): the logits of the rows asked for, kept aside
            step.logits = self.head(hidden, step.rows)
            return torch.zeros(1, device=hidden.device)
        cross_entropy = self.head.loss(hidden, labels)
        step.record_cross_entropy(cross_entropy)
        # As the trainer computes it without a pipeline, operation for operation.
        named = sum(losses.values(), torch.zeros((), device=cross_entropy.device)) / step.named_loss_divisor
        return cross_entropy.reshape(1) / step.cross_entropy_divisor + named  # [1]: the schedules concatenate them


class _AttachLosses(torch.autograd.Function):
    """`hidden` unchanged; in the backward pass each loss gets the gradient 1 / `divisor` (the objective holds the
    losses' sum over `divisor`)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, divisor: Any, *losses: torch.Tensor) -> torch.Tensor:
        ctx.divisor = divisor
        ctx.losses = [(loss.shape, loss.dtype, loss.device) for loss in losses]
        # A copy, not a view: FSDP warns of (and in-place changes would defeat its hooks on) a view as a stage's output.
        return hidden.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        divisor = ctx.divisor
        grads = [torch.ones(shape, dtype=dtype, device=device) / divisor for shape, dtype, device in ctx.losses]
        return grad, None, *grads


def attach_losses(hidden: torch.Tensor, losses: Sequence[torch.Tensor], divisor: Any) -> torch.Tensor:
    """`hidden`, through which the backward pass also reaches `losses`, their sum over `divisor` (a number or a 0-d
    tensor) being part of the objective: for named losses of a stage whose output is not the loss."""
    if not losses or not torch.is_grad_enabled():
        return hidden
    return _AttachLosses.apply(hidden, divisor, *losses)


# -- a step ------------------------------------------------------------------------------------------------------------


@attrs.frozen
class PipelineMicroBatch:
    """What a stage needs of one micro-batch: its tokens and labels (on the device) and its `Batch`. Any object with
    these three attributes will do (the trainer's placed micro-batches)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    batch: Batch


@attrs.define
class _StepState:
    """The step the stages run: its micro-batches and loss divisors, and what the stages record of it."""

    micro_batches: Sequence[PipelineMicroBatch] = ()
    cross_entropy_divisor: Any = 1.0
    named_loss_divisor: Any = 1.0
    cross_entropy: list[torch.Tensor] = attrs.field(factory=list)
    named_losses: dict[str, torch.Tensor] = attrs.field(factory=dict)
    # Inference (`Pipeline.logits`): the rows whose logits the last stage computes, and those logits.
    rows: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    def record_cross_entropy(self, value: torch.Tensor) -> None:
        self.cross_entropy.append(value.detach().float())

    def record_named_losses(self, losses: dict[str, torch.Tensor]) -> None:
        for name, value in losses.items():
            value = value.detach().float()
            self.named_losses[name] = self.named_losses[name] + value if name in self.named_losses else value


@attrs.frozen
class StepLosses:
    """A step's figures, the same on every pipeline rank: the cross-entropy summed over the last stage's labelled
    tokens of every micro-batch (this rank's tokens under sequence-tensor-parallel), and each named loss summed over
    the micro-batches."""

    cross_entropy: torch.Tensor
    named: dict[str, torch.Tensor]


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # The last stage returns its loss already; the schedules need a target (a placeholder) to call this.
    return output.sum()


class Pipeline:
    """This pipeline rank's stages of a model built by `build_pipeline_model`, and the schedules that run them."""

    def __init__(self, model: LanguageModel, distributed: Distributed):
        config = distributed.config
        if config.pipeline_parallel == 1 or distributed.mesh is None:
            raise ValueError("a Pipeline needs distributed.pipeline_parallel > 1")
        self.model = model
        self.distributed = distributed
        self.group = distributed.pipeline_group
        self.rank = distributed.pipeline_rank
        self.num_stages = config.pipeline_stages
        self.stage_blocks = config.stage_blocks(len(model.decoder))
        self.stages = local_stages(distributed)
        self.holds_first, self.holds_last = 0 in self.stages, self.num_stages - 1 in self.stages
        self._step = _StepState()
        self.modules = [
            StageModule(model, stage, self.stage_blocks[stage], self.num_stages, self._step) for stage in self.stages
        ]
        self.tied_group = self._tied_group() if model.config.tied_embedding_weight else None
        # The names of parameters another stage also holds and counts (gradient norm, checkpoint).
        self.copies = {TIED_COPY} if self.tied_group is not None and not self.holds_first else set()
        self._schedules: dict[tuple[bool, int], Any] = {}
        self._named_losses: list[str] | None = None  # the names of every stage's named losses, in one order
        model.pipeline = self  # how inference code (benchmarks: `PipelinedModel`) finds the stages of a model

    def _tied_group(self) -> dist.ProcessGroup | None:
        """The group of the ranks holding the first and the last stage at this rank's data/tensor coordinate."""
        ranks = self.distributed.mesh.mesh  # global ranks, shaped (pipeline, data, sequence_data, tensor)
        last = (self.num_stages - 1) % self.distributed.config.pipeline_parallel
        pairs = [[int(first), int(end)] for first, end in zip(ranks[0].flatten(), ranks[last].flatten())]
        group, _ = dist.new_subgroups_by_enumeration(pairs)
        return group

    # -- running ---------------------------------------------------------------------------------------------------

    def step(
        self, micro_batches: Sequence[PipelineMicroBatch], *, cross_entropy_divisor: Any, named_loss_divisor: Any
    ) -> StepLosses:
        """Forward and backward passes of the step's micro-batches (gradients accumulate in the parameters; the tied
        weight's are summed over its two stages). The gradients are those of the objective: each micro-batch's
        cross-entropy over `cross_entropy_divisor` plus its named losses over `named_loss_divisor`."""
        divisors = (cross_entropy_divisor, named_loss_divisor)
        losses = self._run(micro_batches, training=True, divisors=divisors)
        self._sum_tied_gradients()
        return losses

    @torch.no_grad()
    def evaluate(self, micro_batches: Sequence[PipelineMicroBatch]) -> torch.Tensor:
        """The cross-entropy summed over the labelled tokens of `micro_batches` (this rank's under sequence-tensor-
        parallel), on every pipeline rank."""
        return self._run(micro_batches, training=False, divisors=(1.0, 1.0)).cross_entropy

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor, batch: Batch, rows: torch.Tensor | None = None) -> torch.Tensor:
        """What `LanguageModel.forward_packed(tokens, batch, rows=rows)` returns, on every pipeline rank: the
        packed `tokens` run forward through the stages as one micro-batch, the last stage's logits broadcast over
        the pipeline ranks. Inference batches differ in size, so each call runs a schedule of its own."""
        rows = torch.arange(len(tokens), device=tokens.device) if rows is None else rows
        step = self._step
        step.rows = rows
        try:
            self._run([PipelineMicroBatch(tokens, tokens, batch)], training=False, divisors=(1.0, 1.0), cached=False)
            logits = step.logits
        finally:
            step.rows, step.logits = None, None
        if logits is None:  # the last stage is another rank's
            vocab_size = self.model.config.embeddings.vocab_size
            dtype = self.distributed.compute_dtype
            logits = torch.empty((len(rows), vocab_size), dtype=dtype, device=self.distributed.device)
        last = (self.num_stages - 1) % self.distributed.config.pipeline_parallel
        dist.broadcast(logits, group=self.group, group_src=last)
        return logits

    def _run(
        self,
        micro_batches: Sequence[PipelineMicroBatch],
        *,
        training: bool,
        divisors: tuple[Any, Any],
        cached: bool = True,
    ) -> StepLosses:
        count = len(micro_batches)
        sizes = {len(micro.tokens) for micro in micro_batches}
        if len(sizes) != 1:
            raise ValueError(f"pipeline micro-batches must all have the same number of tokens, got {sorted(sizes)}")
        step = self._step
        step.micro_batches, (step.cross_entropy_divisor, step.named_loss_divisor) = micro_batches, divisors
        step.cross_entropy, step.named_losses = [], {}
        schedule = self._schedule(training, count, sizes.pop(), cached=cached)
        args = (torch.cat([micro.tokens for micro in micro_batches]),) if self.holds_first else ()
        # The target is a placeholder the schedules need on the last stage, which computed its loss itself.
        target = torch.zeros(count, device=self.distributed.device) if self.holds_last else None
        index = torch.arange(count)
        try:
            if training:
                schedule.step(*args, target=target, micro_batch=index)
            else:
                schedule.eval(*args, target=target, micro_batch=index)
            return self._gather(step, named=training)
        finally:
            step.micro_batches, step.cross_entropy, step.named_losses = (), [], {}

    def _schedule(self, training: bool, count: int, tokens: int, *, cached: bool = True) -> Any:
        """The schedule of `count` micro-batches of `tokens` tokens (made on first use and kept, unless not
        `cached`; evaluation has its own stages, since a stage keeps the buffers of the first schedule that ran it)."""
        key = (training, count)
        if cached and key in self._schedules:
            return self._schedules[key]
        if training:
            self.distributed.config.check_pipeline(len(self.model.decoder), count)
        stages = [self._pipeline_stage(module, tokens) for module in self.modules]
        options = {"loss_fn": _loss, "scale_grads": False}  # the loss is normalized already
        if len(stages) == 1:
            schedule = (Schedule1F1B if training else ScheduleGPipe)(stages[0], count, **options)
        else:
            schedule = (ScheduleInterleaved1F1B if training else ScheduleLoopedBFS)(stages, count, **options)
        if cached:
            self._schedules[key] = schedule
        return schedule

    def _pipeline_stage(self, module: StageModule, tokens: int) -> PipelineStage:
        """torch's stage around `module`, told its input and output shapes (no shape inference at run time)."""
        distributed = self.distributed
        hidden_tokens = len(own_tokens(torch.empty(tokens, device="meta"), distributed))
        hidden = torch.empty(
            (hidden_tokens, self.model.config.hidden_size), dtype=distributed.compute_dtype, device="meta"
        ).requires_grad_()
        first, last = module.stage == 0, module.stage == self.num_stages - 1
        inputs = torch.empty(tokens, dtype=torch.int64, device="meta") if first else hidden
        outputs = torch.empty(1, dtype=torch.float32, device="meta").requires_grad_() if last else hidden
        return PipelineStage(
            module,
            module.stage,
            self.num_stages,
            distributed.device,
            input_args=inputs,
            output_args=outputs,
            group=self.group,
        )

    def _gather(self, step: _StepState, *, named: bool) -> StepLosses:
        """The step's cross-entropy and (if `named`: training) named losses summed over the pipeline ranks (each
        stage knows its own)."""
        device = self.distributed.device
        if not named:
            cross_entropy = (
                torch.stack(step.cross_entropy).sum() if step.cross_entropy else torch.zeros((), device=device)
            )
            dist.all_reduce(cross_entropy, group=self.group)
            return StepLosses(cross_entropy=cross_entropy, named={})
        if self._named_losses is None:  # The same every step: exchanged once.
            names: list[list[str]] = [[] for _ in range(self.distributed.config.pipeline_parallel)]
            dist.all_gather_object(names, sorted(step.named_losses), group=self.group)
            self._named_losses = [name for rank_names in names for name in rank_names]
        names = self._named_losses
        missing = [name for name in step.named_losses if name not in names]
        if missing:
            raise RuntimeError(f"named losses {missing} appeared after the first step; every step must add the same")
        values = torch.zeros(1 + len(names), device=device)
        if step.cross_entropy:
            values[0] = torch.stack(step.cross_entropy).sum()
        for position, name in enumerate(names, start=1):
            if name in step.named_losses:
                values[position] = step.named_losses[name]
        dist.all_reduce(values, group=self.group)
        return StepLosses(cross_entropy=values[0], named=dict(zip(names, values[1:])))

    def _sum_tied_gradients(self) -> None:
        if self.tied_group is None:
            return
        weight = self.model.embeddings.word_embeddings
        if weight.grad is not None:  # under FSDP, both copies' shards hold the same rows
            dist.all_reduce(local_tensor(weight.grad), group=self.tied_group)
