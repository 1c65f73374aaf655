"""Fused linear cross-entropy: the loss of `hidden @ weight.T` without the logits of every token ever existing.

The output projection of a language model makes `[tokens, vocab]` logits, by far the largest activation (a
128k vocabulary over 16k tokens: 4 GB in bf16, 8 GB more in fp32 for the loss, as much again for their
gradient). Here the tokens are processed in chunks: the forward pass computes a chunk's logits in the compute
dtype, their fp32 log-sum-exp and target logit (the loss), and at once the gradient of the chunk's logits
(softmax − one-hot), from which it accumulates the gradients of the hidden states (compute dtype) and of the
weight (fp32); then the chunk's temporaries are dropped. The backward pass only scales those gradients by the
incoming one. When no gradient is wanted (evaluation, `torch.no_grad`), only the loss is computed.

Vocabulary-parallel (a `tensor_group` of size > 1): `weight` holds this rank's rows of the vocabulary. Each rank
computes its columns of every token's logits; the per-token log-sum-exp combines over the group (one all-gather
of two numbers per token), the target logit comes from the rank whose columns hold the label, so the loss is the
same on every rank. Each rank's hidden-state gradient covers its columns only: the input enters the tensor
region (`copy_to_tensor_region`, or under sequence-tensor-parallel `gather_tokens`), whose backward sums it.

The fp32 elementwise work of a chunk is plain PyTorch on the CPU. On CUDA a single process's chunk takes one Triton
kernel (`cross_entropy_kernel`) that reads the compute-dtype logits twice and writes the gradient over them; the
vocabulary-parallel statistics go through `torch.compile` of the plain code. `kernel=` or
BLOCKZOO_CROSS_ENTROPY_KERNEL chooses another (`KERNELS`).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os

import attrs
import torch
from torch.distributed import ProcessGroup

from blockzoo.distributed.ops import all_gather_tensors, copy_to_tensor_region, gather_tokens
from blockzoo.layers.base import IGNORE_INDEX

# A chunk's logits hold at most this many elements, per device type: past it the time per token no longer drops
# while the fp32 temporaries keep growing (a few million elements on a CPU; 2^29, 4.4 GiB of temporaries, on a
# large GPU, where bigger chunks keep the matrix products efficient).
CHUNK_ELEMENTS = {"cpu": 2**22, "cuda": 2**29}
DEFAULT_CHUNK_ELEMENTS = 2**24

# How the elementwise fp32 part of a chunk is computed: "plain" PyTorch, "compiled" (torch.compile of the same
# functions) or "triton" (a single process's chunks through `cross_entropy_kernel`; the vocabulary-parallel
# statistics stay as on that device). On the CPU plain (no gain measured from compiling there, and the compile time
# would dominate the tests); on CUDA the Triton kernel, which beats the compiled chunk on an H100 (a 128256
# vocabulary: 3 % less time, 0.8× the memory; `benchmarks/kernels.py --cases ce-128256` times both).
# KERNEL_VARIABLE, or the `kernel` argument, chooses one.
KERNELS = ("plain", "compiled", "triton")
CUDA_KERNEL = "triton"
KERNEL_VARIABLE = "BLOCKZOO_CROSS_ENTROPY_KERNEL"


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    tensor_group: ProcessGroup | None = None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    sequence_parallel: bool = False,
    chunk_tokens: int | None = None,
    return_token_losses: bool = False,
    kernel: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The cross-entropy of the logits `hidden @ weight.T`, summed over the tokens whose label is not `ignore_index`
    (fp32, whatever the compute dtype), differentiable with respect to `hidden` and `weight`.

    `hidden` `[tokens, hidden]` is in the compute dtype; `weight` `[rows, hidden]` may be fp32 master weights (cast
    here; its gradient comes back in its own dtype). `labels` `[tokens]`: vocabulary ids or `ignore_index`.
    `tensor_group`: vocabulary-parallel over this group; `weight` is then this rank's rows `[vocab_start,
    vocab_start + rows)`, `hidden` and `labels` the same on every rank, and so is the result. `vocab_size`: the
    true vocabulary; rows at or beyond it are padding, left out of the softmax (and given no gradient).
    `sequence_parallel`: `hidden` and `labels` are this rank's contiguous share of the tokens (sequence-tensor-
    parallel); they are gathered from the group first and the loss covers all of them. `chunk_tokens`: tokens per
    chunk (default: from the sizes, see `CHUNK_ELEMENTS`). `return_token_losses`: also return the loss of each
    token `[tokens]` (all of the group's under `sequence_parallel`; zero where ignored; not differentiable).
    `kernel`: how a chunk's elementwise part is computed, one of `KERNELS` (default: KERNEL_VARIABLE where set, else
    plain on the CPU and `CUDA_KERNEL` on CUDA).
    """
    if hidden.ndim != 2 or weight.ndim != 2 or labels.ndim != 1:
        raise ValueError(
            "linear_cross_entropy takes hidden [tokens, hidden], weight [rows, hidden] and labels [tokens], got "
            f"shapes {tuple(hidden.shape)}, {tuple(weight.shape)} and {tuple(labels.shape)}"
        )
    if hidden.shape[1] != weight.shape[1] or len(labels) != len(hidden):
        raise ValueError(
            f"linear_cross_entropy: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and labels "
            f"{tuple(labels.shape)} do not match (hidden sizes, then token counts)"
        )
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"linear_cross_entropy: chunk_tokens must be at least 1, got {chunk_tokens}")
    kernel = _chosen_kernel(kernel, hidden.device)
    parallel = tensor_group is not None and tensor_group.size() > 1
    if not parallel:
        tensor_group = None
    if vocab_size is None:
        vocab_size = vocab_start + weight.shape[0] if not parallel else tensor_group.size() * weight.shape[0]
    if sequence_parallel and parallel:
        hidden = gather_tokens(hidden, tensor_group)
        labels = torch.cat(all_gather_tensors(labels, tensor_group))
    else:
        hidden = copy_to_tensor_region(hidden, tensor_group)
    _check_labels(labels, ignore_index, vocab_size)
    options = _Options(
        group=tensor_group,
        ignore_index=ignore_index,
        vocab_start=vocab_start,
        valid_rows=max(0, min(weight.shape[0], vocab_size - vocab_start)),
        chunk_tokens=chunk_tokens,
        kernel=kernel,
    )
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        loss, token_losses = _LinearCrossEntropy.apply(hidden, weight, labels, options)
    else:
        token_losses, _, _ = _chunked(hidden, weight, labels, options, hidden_gradient=False, weight_gradient=False)
        loss = token_losses.sum()
    return (loss, token_losses) if return_token_losses else loss


def _chosen_kernel(requested: str | None, device: torch.device) -> str:
    """`requested`, else KERNEL_VARIABLE's value, else the device's default; refused where it cannot run."""
    kernel = requested or os.environ.get(KERNEL_VARIABLE) or (CUDA_KERNEL if device.type == "cuda" else "plain")
    if kernel not in KERNELS:
        raise ValueError(
            f"linear_cross_entropy: kernel {kernel!r} (the argument or {KERNEL_VARIABLE}); expected one of "
            + ", ".join(KERNELS)
        )
    if kernel == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("linear_cross_entropy: the triton kernel needs CUDA tensors (or TRITON_INTERPRET=1)")
    if kernel == "triton" and importlib.util.find_spec("triton") is None:
        raise ValueError("linear_cross_entropy: the triton kernel needs the triton package (pip install triton)")
    return kernel


def _check_labels(labels: torch.Tensor, ignore_index: int, vocab_size: int) -> None:
    # A label out of range would otherwise give a silently wrong loss (no rank holds its column). On a GPU the check
    # is an asynchronous device assertion: reading the result back would stall the host at every micro-batch.
    outside = (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))
    if labels.device.type != "cpu":
        torch._assert_async(
            ~outside.any(), f"linear_cross_entropy: a label is outside the vocabulary [0, {vocab_size})"
        )
        return
    if bool(outside.any()):
        bad = int(labels[outside][0])
        raise ValueError(f"linear_cross_entropy: label {bad} is outside the vocabulary [0, {vocab_size})")


@attrs.frozen(kw_only=True)
class _Options:
    """What the chunk loop needs besides the tensors."""

    group: ProcessGroup | None
    ignore_index: int
    vocab_start: int
    valid_rows: int  # this rank's rows that are not padding
    chunk_tokens: int | None
    kernel: str


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, options: _Options):
        token_losses, grad_hidden, grad_weight = _chunked(
            hidden,
            weight,
            labels,
            options,
            hidden_gradient=ctx.needs_input_grad[0],
            weight_gradient=ctx.needs_input_grad[1],
        )
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.mark_non_differentiable(token_losses)
        return token_losses.sum(), token_losses

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_token_losses: torch.Tensor | None):
        grad_hidden, grad_weight = ctx.saved_tensors
        # In place: these are this call's own buffers (a second backward through the graph is refused by autograd's
        # check of the saved tensors' versions).
        if grad_hidden is not None:
            grad_hidden.mul_(grad_loss.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None


def _chunked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    options: _Options,
    *,
    hidden_gradient: bool,
    weight_gradient: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(The loss of each token, the gradient of the summed loss w.r.t. hidden and weight or None), chunk by chunk."""
    tokens = len(hidden)
    valid = options.valid_rows
    projection = weight[:valid].to(hidden.dtype)  # the padding rows never enter the softmax
    labelled = labels != options.ignore_index
    targets = labels - options.vocab_start  # the target's column among this rank's, -1 when not here
    targets = torch.where(labelled & (targets >= 0) & (targets < valid), targets, -1)
    token_losses = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
    grad_hidden = None
    if hidden_gradient:  # a rank of padding rows only contributes nothing to it
        grad_hidden = torch.empty_like(hidden) if valid else torch.zeros_like(hidden)
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if weight_gradient else None
    gradients = hidden_gradient or weight_gradient
    statistics, softmax_gradient, loss_and_gradient = _elementwise(options.kernel, hidden.device)
    # From the rows, not the valid rows: every rank of the group must cut the same chunks (their statistics meet).
    chunk = _chunk_tokens(tokens, weight.shape[0], hidden.device, options.chunk_tokens)
    for start in range(0, tokens, chunk):
        end = min(start + chunk, tokens)
        chunk_hidden, chunk_targets, chunk_labelled = hidden[start:end], targets[start:end], labelled[start:end]
        logits = torch.mm(chunk_hidden, projection.T)
        if options.group is None and gradients and valid:
            lse, target, gradient = loss_and_gradient(logits, chunk_targets, chunk_labelled)
        else:
            if valid:
                lse, target = statistics(logits, chunk_targets)
            else:  # a rank holding only padding rows (a vocabulary smaller than the tensor-parallel size demands)
                lse = torch.full((end - start,), -math.inf, device=hidden.device)
                target = torch.zeros(end - start, device=hidden.device)
            if options.group is not None:
                lse, target = _combine(lse, target, options.group)
            gradient = None
            if gradients and valid:
                gradient = softmax_gradient(logits, _ignored_to_inf(lse, chunk_labelled), chunk_targets)
        del logits
        token_losses[start:end] = torch.where(chunk_labelled, lse - target, 0.0)
        if gradient is not None:
            if grad_hidden is not None:
                torch.mm(gradient, projection, out=grad_hidden[start:end])
            if grad_weight is not None:
                _accumulate_product(grad_weight[:valid], gradient.T, chunk_hidden)
            del gradient
    return token_losses, grad_hidden, grad_weight


def _accumulate_product(accumulator: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    """`accumulator += left @ right` for an fp32 `accumulator` and factors in the compute dtype.

    Where the device can (CUDA's `addmm` with `out_dtype`), the product goes straight into the fp32 accumulator:
    a temporary product in the compute dtype, added afterwards, would read and write the whole `[vocab, hidden]`
    gradient twice more per chunk, which is what separated this loss from liger-kernel's.
    """
    if left.dtype == accumulator.dtype:
        accumulator.addmm_(left, right)
    elif _accumulates_in_place(accumulator.device):
        torch.addmm(accumulator, left, right, out_dtype=accumulator.dtype, out=accumulator)
    else:
        accumulator += torch.mm(left, right)


_IN_PLACE_ACCUMULATION: dict[str, bool] = {}


def _accumulates_in_place(device: torch.device) -> bool:
    """Whether `addmm(out_dtype=fp32)` of compute-dtype factors works on this kind of device (tried once)."""
    if device.type not in _IN_PLACE_ACCUMULATION:
        works = device.type == "cuda"
        if works:
            try:
                accumulator = torch.ones(2, 2, device=device)
                factor = torch.ones(2, 2, device=device, dtype=torch.bfloat16)
                torch.addmm(accumulator, factor, factor, out_dtype=torch.float32, out=accumulator)
                works = bool((accumulator == 3).all())
            except (RuntimeError, TypeError):  # older torch: no out_dtype
                works = False
        _IN_PLACE_ACCUMULATION[device.type] = works
    return _IN_PLACE_ACCUMULATION[device.type]


def _chunk_tokens(tokens: int, columns: int, device: torch.device, requested: int | None) -> int:
    """Tokens per chunk: within the element budget, and balanced so that the last chunk is not a sliver."""
    if requested is None:
        requested = max(1, CHUNK_ELEMENTS.get(device.type, DEFAULT_CHUNK_ELEMENTS) // max(columns, 1))
    chunks = max(1, -(-tokens // requested))
    return max(1, -(-tokens // chunks))


def _combine(lse: torch.Tensor, target: torch.Tensor, group: ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's (log-sum-exp over its columns, target logit or 0) → the whole vocabulary's, on every rank."""
    gathered = torch.stack(all_gather_tensors(torch.stack([lse, target]), group))  # [ranks, 2, tokens]
    return torch.logsumexp(gathered[:, 0], 0), gathered[:, 1].sum(0)


def _ignored_to_inf(lse: torch.Tensor, labelled: torch.Tensor) -> torch.Tensor:
    # exp(logit - inf) = 0: the softmax gradient of an ignored token is zero without another pass over its row.
    return torch.where(labelled, lse, math.inf)


# -- the elementwise fp32 part of a chunk -----------------------------------------------------------------------------


def _statistics(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 log-sum-exp of each row of `logits` `[tokens, columns]`, and the logit of each row's target column (0
    where the target is -1: not among these columns)."""
    logits = logits.float()
    maximum = logits.amax(1, keepdim=True)
    lse = (logits - maximum).exp_().sum(1).log_() + maximum.squeeze(1)
    target = logits.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
    return lse, torch.where(targets >= 0, target, 0.0)


def _softmax_gradient(
    logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, *, pointwise: bool = False
) -> torch.Tensor:
    """softmax − one-hot(target) of each row, in the logits' dtype (the gradient of the row's loss w.r.t. its
    logits); `lse` is the row's log-sum-exp over the whole vocabulary, +inf for a row to zero.

    The one-hot goes in with a scatter into the fp32 rows (eagerly the fastest: on a CPU a tenth of the time of the
    alternative), or, `pointwise`, by comparing each column with the row's target: what the compiled path takes,
    because a scatter makes the compiler materialize the fp32 rows (an 8192-token chunk of a 50288 vocabulary:
    1.5 GiB more at the step's peak) where the comparison fuses into the one pass writing the result."""
    gradient = (logits.float() - lse.unsqueeze(1)).exp_()
    if pointwise:
        hit = torch.arange(logits.shape[1], device=logits.device) == targets.unsqueeze(1)  # never for target -1
        return torch.where(hit, gradient - 1, gradient).to(logits.dtype)
    gradient.scatter_add_(1, targets.clamp(min=0).unsqueeze(1), -(targets >= 0).float().unsqueeze(1))
    return gradient.to(logits.dtype)


def _loss_and_gradient(
    logits: torch.Tensor, targets: torch.Tensor, labelled: torch.Tensor, *, pointwise: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A single process's chunk in one function (one compiled graph): statistics, then the softmax gradient."""
    lse, target = _statistics(logits, targets)
    return lse, target, _softmax_gradient(logits, _ignored_to_inf(lse, labelled), targets, pointwise=pointwise)


_PLAIN = (_statistics, _softmax_gradient, _loss_and_gradient)
_compiled: tuple | None = None


def _elementwise(kernel: str, device: torch.device) -> tuple:
    """(statistics, softmax_gradient, loss_and_gradient) for `kernel`; with "triton" the first two (the
    vocabulary-parallel path's) are compiled on CUDA, plain elsewhere."""
    global _compiled
    if kernel == "triton":
        from blockzoo.layers.cross_entropy_kernel import loss_and_gradient

        others = "compiled" if device.type == "cuda" else "plain"
        return (*_elementwise(others, device)[:2], loss_and_gradient)
    if kernel == "plain":
        return _PLAIN
    if _compiled is None:
        statistics, softmax_gradient, loss_and_gradient = _PLAIN
        _compiled = (
            torch.compile(statistics),
            torch.compile(functools.partial(softmax_gradient, pointwise=True)),
            torch.compile(functools.partial(loss_and_gradient, pointwise=True)),
        )
    return _compiled
