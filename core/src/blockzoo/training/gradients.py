"""The sums a step takes over ranks: the loss and named losses (`StepReductions`), and the global gradient norm and
its clipping (`GradientNorm`).

Each rank's gradients cover its share of the model; the squares of their norms are summed over the ranks that split
them: over the tensor group (tensor-parallel splits), the data group (experts split over it under expert
parallelism), the data and sequence-data ranks (FSDP shards over them) and the pipeline stages (each counting its own
parameters: a tied weight's copy on the last stage is the first stage's).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from blockzoo.distributed.data_parallel import is_sharded
from blockzoo.distributed.pipeline import Pipeline
from blockzoo.distributed.runtime import Distributed, local_tensor

# How the squares of a parameter's gradient are summed over data ranks: kept whole (replicated), experts split over
# the data group, FSDP shards over data × sequence-data.
REPLICATED, EXPERTS, FSDP_SHARDS = 0, 1, 2


def sum_over(tensor: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
    """`tensor` summed in place over `group` (a group of one, or none: as it is)."""
    if group is not None and size > 1:
        dist.all_reduce(tensor, group=group)
    return tensor


class StepReductions:
    """A step's loss figures summed over the ranks that split its tokens (on the device, no wait)."""

    def __init__(self, distributed: Distributed):
        self.distributed = distributed

    def over_data(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the data and sequence-data ranks (each counts its own tokens)."""
        return sum_over(tensor, self.distributed.data_sequence_group, self.distributed.data_sequence_size)

    def loss(self, cross_entropy: torch.Tensor) -> torch.Tensor:
        """The cross-entropy summed over every labelled token of the step, on every rank."""
        if self.distributed.sequence_tensor_parallel:
            dist.all_reduce(cross_entropy, group=self.distributed.tensor_group)
        return self.over_data(cross_entropy)

    def named(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each named loss summed over the data ranks (every tensor rank computes the same: routing sees all tokens;
        so does every sequence-data rank: `slice_losses` covers the whole micro-batch)."""
        group = self.distributed.data_group
        if not named or group is None or self.distributed.data_size == 1:
            return named
        values = torch.stack(list(named.values()))
        dist.all_reduce(values, group=group)
        return dict(zip(named, values.unbind()))


class GradientNorm:
    """The global gradient norm of `model`'s trainable parameters, and clipping to it. The parameters are grouped
    once (not per step: a step of a small model is bound by the host's work) by how the squares of their gradients
    are summed: (tensor-parallel split, REPLICATED / EXPERTS / FSDP_SHARDS, parameters of one dtype)."""

    def __init__(self, model: nn.Module, distributed: Distributed, pipeline: Pipeline | None):
        self.distributed = distributed
        self.pipelined = pipeline is not None
        copies = set() if pipeline is None else pipeline.copies  # a stage's copy of a tied weight: the first counts it
        groups: dict[tuple[int, int, torch.dtype], list[nn.Parameter]] = {}
        for name, parameter in model.named_parameters():
            if not parameter.requires_grad or name in copies:
                continue
            meta = parameter.meta
            split = EXPERTS if meta.data_parallel_sharded else FSDP_SHARDS if is_sharded(parameter) else REPLICATED
            groups.setdefault((int(meta.tensor_parallel), split, parameter.dtype), []).append(parameter)
        self.groups = [(parallel, split, parameters) for (parallel, split, _), parameters in groups.items()]

    def __call__(self) -> torch.Tensor:
        """The global gradient norm (on the device)."""
        distributed = self.distributed
        # squares[tensor-parallel split][REPLICATED, EXPERTS, FSDP_SHARDS]
        squares = torch.zeros(2, 3, device=distributed.device)
        # One multi-tensor norm per group: a few kernels in all, not several per parameter (a step of a small model
        # is bound by the host's kernel launches).
        for parallel, split, parameters in self.groups:
            grads = [local_tensor(parameter.grad) for parameter in parameters if parameter.grad is not None]
            if grads:
                squares[parallel, split] += torch.stack(torch._foreach_norm(grads, 2)).float().pow(2).sum()
        sum_over(squares[1], distributed.tensor_group, distributed.tensor_size)
        for split, group, size in (
            (EXPERTS, distributed.data_group, distributed.data_size),
            (FSDP_SHARDS, distributed.data_sequence_group, distributed.data_sequence_size),
        ):
            if group is not None and size > 1:
                squares[:, split] = sum_over(squares[:, split].contiguous(), group, size)
        if self.pipelined:
            dist.all_reduce(squares, group=distributed.pipeline_group)
        return squares.sum().sqrt()

    def clip(self, trainable: list[nn.Parameter], limit: float | None) -> torch.Tensor:
        """The global gradient norm (on the device), the gradients clipped to `limit` (None: not clipped)."""
        norm = self()
        grads = [] if limit is None else [local_tensor(p.grad) for p in trainable if p.grad is not None]
        if grads:
            # As torch.nn.utils.clip_grad_norm_: a factor of at most 1, computed and applied on the device.
            torch._foreach_mul_(grads, (limit / (norm + 1e-6)).clamp(max=1.0))
        return norm
