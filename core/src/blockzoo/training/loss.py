"""A training step's loss and its gradients.

One optimizer step takes `gradient_accumulation` micro-batches on each data-parallel rank. The loss
is the cross-entropy summed over every labelled token of the step (all micro-batches, all ranks)
divided by their count, plus the layers' named losses averaged over the micro-batches of all ranks,
so the gradients do not depend on how the step is split. Each rank's backward pass covers its share
of that sum: gradients of replicated parameters that saw token shards (sequence-tensor-parallel) are
summed over the tensor group, then all gradients are summed over the data-parallel ranks.

Under sequence-data parallelism the sequence-data ranks of one data rank read the same micro-batches and each runs
its slices of them (`step.place_micro_batch`): each computes the cross-entropy of its own tokens (summed, like the
labelled-token count, over data × sequence_data), and the named losses of the whole micro-batch, the same on each
(summed over the data ranks only); gradients are summed over data × sequence_data (FSDP's folded mesh).
"""

from __future__ import annotations

import torch
from torch import nn

from blockzoo.distributed.data_parallel import prepare_micro_batch
from blockzoo.distributed.pipeline import Pipeline
from blockzoo.distributed.runtime import Distributed
from blockzoo.training.gradients import StepReductions
from blockzoo.training.step import PlacedMicroBatch


def forward_backward(
    model: nn.Module, pipeline: Pipeline | None, distributed: Distributed, micro_batches: list[PlacedMicroBatch]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The forward and backward passes of a step's micro-batches (of this rank): leaves the gradients of the
    step's loss, reduced over the data ranks, and returns on the device (no wait) the step's loss (the
    cross-entropy over the labelled tokens of all ranks) and its named losses (each averaged over the
    micro-batches of all ranks), the same on every rank.

    The objective of each micro-batch is its summed cross-entropy over the step's labelled-token count (all
    ranks), plus its named losses over the step's micro-batch count (all ranks): the gradients summed over the
    micro-batches and the data ranks are those of the step's loss, however the step is split.
    """
    reductions = StepReductions(distributed)
    device = distributed.device
    labelled = reductions.over_data(sum(micro.labelled() for micro in micro_batches)).clamp(min=1)
    micro_batches_of_all_ranks = len(micro_batches) * distributed.data_size
    if pipeline is not None:  # the schedule runs the micro-batches through this rank's stages
        step = pipeline.step(
            micro_batches, cross_entropy_divisor=labelled, named_loss_divisor=micro_batches_of_all_ranks
        )
        named = {name: value / micro_batches_of_all_ranks for name, value in step.named.items()}
        return reductions.loss(step.cross_entropy) / labelled, reductions.named(named)
    total_cross_entropy = torch.zeros((), device=device)
    named: dict[str, torch.Tensor] = {}
    for index, micro in enumerate(micro_batches):
        prepare_micro_batch(model, distributed, last=index + 1 == len(micro_batches))
        cross_entropy, losses = model.loss(micro.tokens, micro.labels, micro.batch)
        extra = sum(losses.values(), torch.zeros((), device=device)) / micro_batches_of_all_ranks
        (cross_entropy / labelled + extra).backward()
        total_cross_entropy += cross_entropy.detach().float()
        for name, value in losses.items():
            named[name] = named.get(name, 0.0) + value.detach().float() / micro_batches_of_all_ranks
    return reductions.loss(total_cross_entropy) / labelled, reductions.named(named)
