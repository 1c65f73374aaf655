"""What the run config asks of a built model beyond its layers, applied from outside it (as torchtitan's
`parallelize`): activation recomputation and torch.compile of each block, then sharded data parallelism (ZeRO,
through FSDP2: `blockzoo.distributed.data_parallel`).

The model's code knows none of it: each policy replaces a block's `forward` on the instance, so parameter names,
checkpoints and the module tree stay those of the plain model.

- Recomputation (`training.recompute`, per named block `training.recompute_blocks`), with torch's non-reentrant
  `torch.utils.checkpoint`: `full` keeps only the block's input; `selective` keeps the outputs of the operations
  that are expensive to redo (matrix products, attention, collectives: `SAVED_OPERATIONS`) and recomputes the rest.
  A layer that adds a named loss (`Batch.add_loss`) adds it once: the recomputation's additions are dropped. A
  block's `forward_slice` (slices of sequences) is recomputed by the same policy; its carry is an output like the
  hidden states (the next slice's block depends on it), so it is recomputed too, never kept twice.
- Compilation (`training.compile: blocks`): each block's training forward goes through `torch.compile` (the
  backward is compiled with it). Blocks of one configuration share the compiled code. Only calls that build a
  graph (training) take it; evaluation, `no_grad` calls and generation run eagerly, so they never trigger a
  compilation of their own shapes. Recomputing a compiled block is the compiler's job: its min-cut partitioner
  chooses what to keep under a memory budget (`COMPILED_RECOMPUTE_BUDGETS`: `full` recomputes all it can,
  `selective` keeps about half). torch.utils.checkpoint around or inside a compiled block does not work with the
  blocks' per-batch caches: on one H200 (Llama-1B shape) selective checkpointing traced inside a compiled block
  fell back to eager code, and recomputing a compiled block from outside recompiled it with other saved
  tensors (torch's checkpoint then refuses the recomputed values).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from blockzoo.distributed.data_parallel import shard_data_parallel
from blockzoo.layers.base import Batch
from blockzoo.run_config import RunConfig


def parallelize(model: nn.Module, run_config: RunConfig, stages: Sequence[nn.Module] | None = None) -> nn.Module:
    """Apply the run's recomputation and compilation policies, then its data parallelism (`distributed.zero_stage`,
    over the data ranks of `model.distributed`) to `model` (a `LanguageModel`), in place. Build the optimizer after:
    FSDP replaces the parameters. Under pipeline parallelism, `stages` are this rank's pipeline stages
    (`blockzoo.distributed.pipeline.StageModule`): each is an FSDP root, its blocks its units."""
    training = run_config.training
    options = {}
    if training.fp8 is not None:  # first: compilation traces the FP8 products, FSDP wraps the FP8-gathered weights
        from blockzoo.distributed.fp8 import compile_options, prepare_fp8

        prepare_fp8(model, run_config)
        options = compile_options()
    for (name, _), block in zip(run_config.model.decoder.expanded_blocks(), model.decoder, strict=True):
        policy = training.recompute_blocks.get(name, training.recompute)
        if training.compile == "blocks":
            budget = COMPILED_RECOMPUTE_BUDGETS.get(policy)
            block.forward = compiled(block.forward, memory_budget=budget, options=options)
        elif policy != "none":
            block.forward = recomputed(block.forward, selective=policy == "selective")
            if hasattr(block, "forward_slice"):  # not a pipeline stage held elsewhere (RemotePart)
                block.forward_slice = recomputed_slice(block.forward_slice, selective=policy == "selective")
    if stages is None:
        shard_data_parallel(model, model.decoder, model.distributed)
    for stage in stages or ():
        shard_data_parallel(stage, stage.blocks.values(), model.distributed, forward_methods=())
    return model


# -- recomputation -----------------------------------------------------------------------------------------------------


def _operations(*names: str) -> frozenset:
    """The torch operations (`namespace.op.overload`) of `names` that this torch has."""
    found = set()
    for name in names:
        namespace, operation, overload = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), operation, None)
        if packet is not None and hasattr(packet, overload):
            found.add(getattr(packet, overload))
    return frozenset(found)


# What `selective` keeps: each costs a matrix product (or a communication) to redo, while what is recomputed
# (normalizations, activations, rotary, casts) costs a pass over memory.
SAVED_OPERATIONS = _operations(
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten._grouped_mm.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._flash_attention_forward.default",
    "aten._efficient_attention_forward.default",
    "torch_attn._varlen_attn.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.all_gather_into_tensor.default",
    "_c10d_functional.all_reduce.default",
)


def _selective_policy(context: Any, operation: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if operation in SAVED_OPERATIONS else CheckpointPolicy.PREFER_RECOMPUTE


def recomputed(forward: Callable, *, selective: bool) -> Callable:
    """`forward(hidden, batch, state=None)` whose activations are recomputed in the backward pass."""

    @functools.wraps(forward)
    def run(hidden: torch.Tensor, batch: Batch, state: Any = None) -> torch.Tensor:
        if state is not None or not torch.is_grad_enabled():  # generation and evaluation keep nothing anyway
            return forward(hidden, batch, state)
        return _checkpointed(forward, batch, selective, hidden, batch, state)

    return run


def recomputed_slice(forward_slice: Callable, *, selective: bool) -> Callable:
    """`forward_slice(hidden, batch, previous) -> (hidden, carry)` whose activations are recomputed in the backward
    pass (the carry's too)."""

    @functools.wraps(forward_slice)
    def run(hidden: torch.Tensor, batch: Batch, previous: Any) -> tuple[torch.Tensor, Any]:
        if not torch.is_grad_enabled():
            return forward_slice(hidden, batch, previous)
        return _checkpointed(forward_slice, batch, selective, hidden, batch, previous)

    return run


def _checkpointed(function: Callable, batch: Batch, selective: bool, *args: Any) -> Any:
    """`function(*args)` under torch's non-reentrant checkpoint; the recomputation's named losses are dropped."""
    passes = 0

    def once(*args: Any) -> Any:
        nonlocal passes
        passes += 1
        if passes == 1:
            return function(*args)
        # The first pass added the named losses already.
        kept, batch.losses, batch.statistics = (batch.losses, batch.statistics), {}, {}
        try:
            return function(*args)
        finally:
            batch.losses, batch.statistics = kept

    options = {}
    if selective:
        options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
    return checkpoint(once, *args, use_reentrant=False, **options)


# -- compilation -------------------------------------------------------------------------------------------------------


# The share of its activations a compiled block keeps (torch's min-cut partitioner recomputes the cheapest rest), by
# recomputation policy; without one, what the compiler keeps by default.
COMPILED_RECOMPUTE_BUDGETS = {"selective": 0.5, "full": 0.0}


def compiled(forward: Callable, *, memory_budget: float | None = None, options: dict | None = None) -> Callable:
    """`forward(hidden, batch, state=None)` through torch.compile when it builds a graph (training). With
    `memory_budget`, the compiler keeps about that share of the activations and recomputes the rest; `options` are
    inductor's (torch.compile's `options`)."""
    # Recompilations (a new document layout's maximum length, ...) must not silently fall back to eager.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    compiled_forward = torch.compile(forward, options=options or None)
    # The partition between saved and recomputed activations is chosen when the forward compiles, inside the call.
    budget = (
        contextlib.nullcontext
        if memory_budget is None
        else functools.partial(torch._functorch.config.patch, activation_memory_budget=memory_budget)
    )

    @functools.wraps(forward)
    def run(hidden: torch.Tensor, batch: Batch, state: Any = None) -> torch.Tensor:
        if state is not None or not torch.is_grad_enabled():
            return forward(hidden, batch, state)
        with budget():
            return compiled_forward(hidden, batch, state)

    return run
