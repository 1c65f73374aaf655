"""Debug mode (`distributed.debug`): find the first tensor on which the tensor-parallel ranks disagree.

Tensor parallelism rests on claims each layer makes: that a reduction makes its output the same on every rank,
that a parameter's gradient is complete or flagged for a sum. A false claim rarely fails loudly: the ranks drift
apart and the loss is a little worse. `install(model, distributed)` puts hooks on every module whose output should
be replicated over the tensor group and compares, across that group and in execution order, its output (forward),
the gradient flowing into that output and the gradient it gives its input (backward). The first difference raises
`ParallelMismatchError` naming the module's path (`decoder.3.mixer`), the direction, the ranks and the difference.
`after_step(model, distributed, step)` compares, after each optimizer step, every parameter and gradient that should
be replicated: over the tensor group unless it is split there, over the data group unless it is split there.

What is replicated over the tensor group (the claims checked):
- Without sequence-tensor-parallel, the whole residual stream: the embeddings' output, each block's input and
  output, each part of a block (its mixers, MLP, norms) and the head's norm; the loss and the layers' named losses.
  Each `Linear` by its layout: a column-parallel one's input, a row-parallel one's output after its reduction, a
  replicated one's input and output (e.g. the MoE router logits), one inside the tensor region its input.
- With sequence-tensor-parallel the residual stream is split along tokens: only the outputs of the linears inside
  the tensor region (e.g. MQA's shared key/value) are the same on every rank, in the forward pass; their gradient is
  a partial sum by design, and so are all the others. The parameters and gradients after each step are the check
  that covers the rest there.

Tolerances: activations within `ACTIVATION_TOLERANCES[compute dtype]` (the ranks run the same kernels on the same
inputs, so on the CPU they agree bit for bit; on a GPU a kernel that accumulates with atomics may reorder a sum:
a few units in the last place of the compute dtype). Parameters and gradients exactly: replicated weights updated
from different gradients drift apart, however small the difference.

A check costs two collectives (the shapes, then the copies): debug mode is slow, for finding bugs. Checks are skipped
inside `torch.compile`d code (the blocks of `training.compile: blocks` are still checked at their boundaries).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.hooks import RemovableHandle

from blockzoo.distributed.check import ParallelMismatchError, check_parallel_match, compare_across
from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.linear import Linear

FORWARD, BACKWARD = "forward", "backward"

# torch.testing's tolerances for each dtype, the bf16 one about two units in the last place.
ACTIVATION_TOLERANCES = {
    torch.float32: {"rtol": 1.3e-6, "atol": 1e-5},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-5},
}


@attrs.frozen
class Watch:
    """Which tensors of a module are the same on every tensor-parallel rank."""

    output: bool  # its output (forward)
    output_gradient: bool  # the gradient flowing into its output (backward)
    input_gradient: bool  # the gradient it gives its input (backward)


EVERYTHING = Watch(output=True, output_gradient=True, input_gradient=True)


class DebugHooks:
    """The hooks `install` put on a model; `checked` counts the comparisons made, per direction. `remove()` takes
    them off."""

    def __init__(self, distributed: Distributed):
        self.distributed = distributed
        self.tolerance = ACTIVATION_TOLERANCES.get(distributed.compute_dtype, ACTIVATION_TOLERANCES[torch.bfloat16])
        self.checked = {FORWARD: 0, BACKWARD: 0}
        self._handles: list[RemovableHandle] = []
        self._restore: list[Callable[[], None]] = []

    def check(self, tensor: Any, name: str, direction: str, what: str) -> None:
        """Compare `tensor` (a tensor, or a tuple or list of them), `what` of module `name`, across the tensor group;
        raise at a difference."""
        if isinstance(tensor, (tuple, list)):
            for index, item in enumerate(tensor):
                self.check(item, name, direction, f"{what} {index}")
            return
        where = f"{name} ({direction}: {what})"
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or _compiling():
            return
        group = self.distributed.tensor_group
        try:
            mismatch = compare_across(tensor, group, **self.tolerance)
        except ParallelMismatchError as error:
            raise ParallelMismatchError(f"tensor-parallel ranks disagree at {where}: {error}") from None
        self.checked[direction] += 1
        if mismatch is not None:
            raise ParallelMismatchError(
                f"tensor-parallel ranks disagree at {where}: {mismatch.describe()}; tolerance "
                f"rtol={self.tolerance['rtol']:g}, atol={self.tolerance['atol']:g} "
                f"({self.distributed.config.compute_dtype} compute)"
            )

    def watch(self, module: nn.Module, name: str, watch: Watch = EVERYTHING) -> None:
        """Check `module` (called `name` in the messages) as `watch` says, from its next call on."""
        if watch.input_gradient:
            self._handles.append(module.register_forward_pre_hook(self._input_hook(name)))
        if watch.output or watch.output_gradient:
            self._handles.append(module.register_forward_hook(self._output_hook(name, watch)))

    def watch_loss(self, model: nn.Module) -> None:
        """Check the cross-entropy and the named losses `model.loss` returns."""
        kept = model.__dict__.get("loss")  # a wrapper put on the instance before (e.g. by FSDP) stays under ours
        loss = model.loss

        def checked_loss(*args: Any, **kwargs: Any) -> Any:
            cross_entropy, losses = loss(*args, **kwargs)
            self.check(cross_entropy, "loss", FORWARD, "the cross-entropy")
            for name, value in losses.items():
                self.check(value, "loss", FORWARD, f"the named loss {name}")
            return cross_entropy, losses

        model.loss = checked_loss
        self._restore.append(lambda: setattr(model, "loss", kept) if kept is not None else delattr(model, "loss"))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for restore in self._restore:
            restore()
        self._handles, self._restore = [], []

    def _input_hook(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            for index, arg in enumerate(args):
                self._watch_gradient(arg, name, f"input{'' if index == 0 else f' {index}'}", 0)

        return hook

    def _output_hook(self, name: str, watch: Watch) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if watch.output:
                self.check(output, name, FORWARD, "its output")
            if watch.output_gradient:
                outputs = output if isinstance(output, (tuple, list)) else (output,)
                for index, tensor in enumerate(outputs):
                    self._watch_gradient(tensor, name, f"output{'' if index == 0 else f' {index}'}", 1)

        return hook

    def _watch_gradient(self, tensor: Any, name: str, role: str, order: int) -> None:
        """Check the gradient of `tensor` once it is complete (summed over every use of the tensor).

        A tensor hook changes nothing in the graph, so the gradients stay bit for bit those of the run without debug
        mode (an identity node in the graph would change the order in which the contributions of several uses are
        summed). A tensor that is one module's output and the next one's input is checked once, and named first
        after the module that took it (`order` 0, the one whose backward made its gradient), then after the one
        that made it (`order` 1).
        """
        if not isinstance(tensor, torch.Tensor) or not tensor.requires_grad or _compiling():
            return
        labels = tensor.__dict__.get(_LABELS)
        if labels is None:
            labels = tensor.__dict__[_LABELS] = ([], [])

            def check(grad: torch.Tensor) -> None:
                (name, role), *others = [*labels[0], *labels[1]]
                same = "" if not others else f"; the same tensor as {', '.join(f'{n} {r}' for n, r in others)}"
                self.check(grad, name, BACKWARD, f"the gradient of its {role}{same}")

            tensor.register_hook(check)
        labels[order].append((name, role))


# The names under which the debug mode checks a tensor's gradient, kept on the tensor.
_LABELS = "_blockzoo_debug_gradient_labels"


def _compiling() -> bool:
    return torch.compiler.is_compiling()


# -- what is replicated ------------------------------------------------------------------------------------------------


def linear_watch(linear: Linear, sequence_tensor_parallel: bool) -> Watch | None:
    """What of a `Linear` is the same on every tensor-parallel rank (None: nothing)."""
    if linear.inside_tensor_region:  # its gradients are partial sums: each rank's share of the work uses it
        return Watch(output=True, output_gradient=False, input_gradient=not sequence_tensor_parallel)
    if sequence_tensor_parallel:
        return None
    if linear.column_parallel:
        return Watch(output=False, output_gradient=False, input_gradient=True)
    if linear.row_parallel:
        return Watch(output=True, output_gradient=True, input_gradient=False)
    return EVERYTHING


def _parts(module: nn.Module) -> Iterator[nn.Module]:
    """The parts of a block: its children, looking into lists and dicts of them."""
    for child in module.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            yield from _parts(child)
        else:
            yield child


def watched_modules(model: nn.Module, distributed: Distributed) -> Iterator[tuple[nn.Module, Watch]]:
    """Every module of a `LanguageModel` whose tensors are replicated over the tensor group, with what is."""
    sequence_tensor_parallel = distributed.sequence_tensor_parallel
    residual_stream: set[int] = set()
    if not sequence_tensor_parallel:
        head = getattr(model, "head", None)
        streams = [getattr(model, "embeddings", None), getattr(head, "normalization", None)]
        for block in getattr(model, "decoder", ()):
            streams += [block, *_parts(block)]
        residual_stream = {id(module) for module in streams if module is not None}
    for module in model.modules():
        if isinstance(module, Linear):
            watch = linear_watch(module, sequence_tensor_parallel)
        else:
            watch = EVERYTHING if id(module) in residual_stream else None
        if watch is not None:
            yield module, watch


def install(model: nn.Module, distributed: Distributed) -> DebugHooks:
    """Put the debug checks on `model` (a `LanguageModel`, built): call once, after the model is built and
    parallelized, before the first step. Nothing to compare (and no hook) without tensor parallelism."""
    hooks = DebugHooks(distributed)
    if distributed.tensor_size == 1:
        return hooks
    names = {id(module): name for name, module in model.named_modules()}
    for module, watch in watched_modules(model, distributed):
        hooks.watch(module, names[id(module)], watch)
    if not distributed.sequence_tensor_parallel:  # under it each rank's loss covers its own tokens
        hooks.watch_loss(model)
    return hooks


# -- after each step ---------------------------------------------------------------------------------------------------


def replicated_groups(tensor: torch.Tensor, parameter: nn.Parameter, distributed: Distributed) -> list[tuple[str, Any]]:
    """(label, group) of each group over which `tensor` (the parameter or its gradient) is the same on every rank.

    Over the tensor group unless the parameter is split there (`meta.tensor_parallel`). Over the data group unless it
    is split there: expert parallelism (`meta.data_parallel_sharded`), or FSDP, whose parameters are DTensors: those
    are replicated over the dims of their mesh their placements replicate (ZeRO 0 keeps them whole).
    """
    meta = getattr(parameter, "meta", None)
    groups = []
    if distributed.tensor_size > 1 and meta is not None and not meta.tensor_parallel:
        groups.append(("tensor", distributed.tensor_group))
    if isinstance(tensor, DTensor):
        mesh = tensor.device_mesh
        for dim, placement in enumerate(tensor.placements):
            if isinstance(placement, Replicate) and mesh.size(dim) > 1:
                groups.append(
                    (mesh.mesh_dim_names[dim] if mesh.mesh_dim_names else f"mesh dim {dim}", mesh.get_group(dim))
                )
    elif distributed.data_size > 1 and meta is not None and not meta.data_parallel_sharded:
        groups.append(("data", distributed.data_group))
    return groups


def after_step(model: nn.Module, distributed: Distributed, step: int) -> None:
    """Raise `ParallelMismatchError` at the first parameter or gradient (in the model's order) that differs between
    ranks that should hold the same copy; call on every rank after each optimizer step (the gradients are checked
    while the model still holds them). Parameters made outside `create_parameter` (no `meta`) are not checked."""
    for name, parameter in model.named_parameters():
        for what, tensor in (("parameter", parameter), ("gradient of", parameter.grad)):
            if tensor is None:
                continue
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            for label, group in replicated_groups(tensor, parameter, distributed):
                check_parallel_match(
                    local.detach(), group, f"after step {step}: {what} {name} ({label} group)", raise_on_mismatch=True
                )
