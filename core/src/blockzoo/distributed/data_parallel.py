"""Sharded data parallelism, ZeRO stages 0-3, through PyTorch's FSDP2 (`fully_shard`) over the mesh's data dim.

`shard_data_parallel(module, blocks, distributed)` makes each block one FSDP unit and `module` the root unit (the
embeddings, the head and the tied weight, which must stay in one unit). Under sequence-data parallelism the data dim
is data × sequence_data (`Distributed.data_parallel_mesh`): the sequence-data ranks' gradients are summed with the
data ranks', and ZeRO shards over both. FSDP shards each rank's parameters along
their first dim over the data ranks: under tensor parallelism these are the rank's own tensor-parallel shards, which
FSDP never sees as anything else, so our tensor, sequence-tensor and expert parallelism compose with it unchanged.

- 0: the weights stay whole on every data rank (the mesh is (data, data_shard of size one): HSDP without sharding);
  the gradients are all-reduced after the step's last micro-batch; the optimizer state is whole.
- 1: `reshard_after_forward=False`; the weights are sharded between steps and so is the optimizer state; the
  gradients accumulate whole over the micro-batches and are reduce-scattered once, after the last.
- 2: as 1, but the gradients are reduce-scattered after every micro-batch and accumulate as shards.
- 3: as 2, and `reshard_after_forward=True`: each block's weights are gathered just before its forward and again
  before its backward, and freed after each.

In stages 0-2 the weights gathered for the step's first micro-batch stay gathered until its last backward pass
(`prepare_micro_batch`), so gradient accumulation adds no all-gather; stage 2 trades a reduce-scatter per
micro-batch for gradients that are never whole. The reductions run per unit while the backward pass goes on.

Our losses are normalized over the labelled tokens of all ranks, so gradients are summed over the data ranks, never
averaged (`set_gradient_divide_factor(1.0)`, with sum-only collectives, which gloo needs). Weights are gathered in
fp32: the layers cast them to the compute dtype themselves (SSM parameters such as A_log stay fp32 there).

Parameters already split over the data ranks (`meta.data_parallel_sharded`: the experts of expert parallelism) are
left to FSDP as `ignored_params`: plain tensors whose gradient already holds every rank's tokens. FSDP replaces the
other parameters with `DTensor` ones; their `meta` (`blockzoo.layers.parameter.ParameterMeta`) is attached again,
describing, as before, the rank's tensor-parallel tensor, whose rows `shard_rows` this rank's shard holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Shard

from blockzoo.distributed.runtime import Distributed


def uses_data_parallel_sharding(distributed: Distributed) -> bool:
    """Whether the run goes through FSDP: a mesh, and data (or sequence-data) ranks to reduce over or a ZeRO stage
    asked for (a world of one GPU may run ZeRO 3, to test it)."""
    return distributed.mesh is not None and (distributed.data_sequence_size > 1 or distributed.config.zero_stage > 0)


def shard_data_parallel(
    module: nn.Module,
    blocks: Iterable[nn.Module],
    distributed: Distributed,
    *,
    forward_methods: Sequence[str] = ("loss",),
) -> bool:
    """Apply `distributed.zero_stage` to `module` in place: each of `blocks` (submodules of `module`) one FSDP unit,
    `module` the root. `forward_methods`: methods of `module` the trainer calls instead of `forward`, which FSDP must
    treat as forward passes (gathering the root's weights). Returns whether anything was done (see
    `uses_data_parallel_sharding`). Build the optimizer after this: the parameters are new objects."""
    if not uses_data_parallel_sharding(distributed):
        return False
    metas = {name: parameter.meta for name, parameter in module.named_parameters() if hasattr(parameter, "meta")}
    ignored = {parameter for parameter in module.parameters() if _split_by_expert_parallelism(parameter)}
    stage = distributed.config.zero_stage
    options = {"mesh": distributed.data_parallel_mesh, "ignored_params": ignored}
    for block in blocks:
        fully_shard(block, reshard_after_forward=stage == 3, **options)
        if hasattr(block, "forward_slice"):  # a slice of sequences runs through it, not through forward
            register_fsdp_forward_method(block, "forward_slice")
    # The root holds what the first and last computations use (embeddings, head): gathered once per step.
    fully_shard(module, reshard_after_forward=False, **options)
    for name in forward_methods:
        register_fsdp_forward_method(module, name)
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)  # a sum over the data ranks, not a mean
            if hasattr(unit, "set_force_sum_reduction_for_comms"):  # gloo refuses the pre-multiplied sum otherwise
                unit.set_force_sum_reduction_for_comms(True)
    for name, parameter in module.named_parameters():
        if name in metas:
            parameter.meta = metas[name]
    return True


def prepare_micro_batch(module: nn.Module, distributed: Distributed, *, last: bool) -> None:
    """Before the forward pass of each micro-batch of a step: whether its backward pass reduces the gradients over
    the data ranks (every micro-batch from ZeRO 2 on, else the last only) and frees the gathered weights (the last
    micro-batch, or every one under ZeRO 3). Nothing without FSDP."""
    if not isinstance(module, FSDPModule):
        return
    stage = distributed.config.zero_stage
    module.set_requires_gradient_sync(last or stage >= 2)
    module.set_reshard_after_backward(last or stage == 3)


def reshard(module: nn.Module) -> None:
    """Free the weights FSDP gathered and put the shards back in place (FSDP keeps the gathered ones after a forward
    pass without a backward, such as an evaluation's, for units that do not reshard after their forward): the
    module's parameters are then its DTensor shards again, with their `meta`, as checkpoints and the optimizer
    expect. Nothing without FSDP."""
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


@contextlib.contextmanager
def gathered_for_inference(module: nn.Module, distributed: Distributed) -> Iterator[None]:
    """Within: every FSDP unit of `module` holds its whole weights, gathered once on entry (every data rank enters
    together) and kept through any number of forward passes, which then communicate nothing over the data ranks: the
    ranks may run different numbers of them (benchmark requests, generation that stops early), and methods FSDP does
    not hook (`forward_packed`, `generate`) see plain tensors. On exit the shards are put back. Nothing without
    FSDP."""
    units = [unit for unit in module.modules() if isinstance(unit, FSDPModule)]
    for unit in units:
        unit.unshard()
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            # As `shard_data_parallel` set it: the blocks reshard after their forward under ZeRO 3, the root never.
            unit.set_reshard_after_forward(distributed.config.zero_stage == 3 and unit is not module, recurse=False)


def _split_by_expert_parallelism(parameter: nn.Parameter) -> bool:
    meta = getattr(parameter, "meta", None)
    return meta is not None and meta.data_parallel_sharded


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether `tensor` (an FSDP parameter, its gradient or optimizer state) is split between the data ranks, each
    holding only its rows: ZeRO 1-3 over more than one data rank."""
    return isinstance(tensor, DTensor) and any(
        isinstance(placement, Shard) and tensor.device_mesh.size(dim) > 1
        for dim, placement in enumerate(tensor.placements)
    )


def shard_rows(tensor: torch.Tensor) -> slice:
    """The rows of the whole (tensor-parallel local) tensor that this rank's shard of `tensor` holds: all of them
    unless FSDP shards it. FSDP splits the first dim as `torch.chunk` does: ceil(rows / ranks) each, the last ranks
    fewer or none."""
    if not isinstance(tensor, DTensor):
        return slice(0, tensor.shape[0] if tensor.ndim else 0)
    rows, start, stop = tensor.shape[0], 0, tensor.shape[0]
    for dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Shard):
            if placement.dim != 0:
                raise ValueError(f"FSDP shards along dim {placement.dim}; blockzoo expects its default, dim 0")
            size, rank = tensor.device_mesh.size(dim), tensor.device_mesh.get_local_rank(dim)
            chunk = -(-rows // size)
            start, stop = min(rank * chunk, rows), min((rank + 1) * chunk, rows)
    if stop - start != tensor.to_local().shape[0]:
        raise AssertionError(f"FSDP shard of {stop - start} rows expected, found {tensor.to_local().shape[0]}")
    return slice(start, stop)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole (tensor-parallel local) tensor of an FSDP parameter, gradient or optimizer state, gathered over the
    data ranks (every one of them must call this); any other tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def shard_like(like: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of the whole `tensor`, laid out as `like` (an FSDP parameter: a DTensor with its rows of
    `tensor`, no communication); `tensor` itself when `like` is no DTensor."""
    if not isinstance(like, DTensor):
        return tensor
    rows = shard_rows(like)
    local = tensor[rows].to(like.to_local().device).contiguous()
    return DTensor.from_local(local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride())
