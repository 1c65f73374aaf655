"""How the (token, expert) pairs move: sorted by expert for the experts' products (`ExpertOrder`, `Dispatch`),
weighted and summed back per token (`Combine`), and exchanged between the ranks under expert parallelism
(`products_on_expert_ranks`). The permutation is computed once per forward and reused by the backward. Both ways
between the tokens and the sorted pairs are gathers: the dispatch's backward sums each token's k gradient rows, and
the combine is a weighted sum over each token's k output rows, never a scatter-add (no atomics, no sort in the
backward).

`BLOCKZOO_MOE_COMPILE=1` runs the small elementwise pieces (the gathers with their sums and scalings, the gated
activation) through `torch.compile` on CUDA, so each is one fused kernel; off by default.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import torch.distributed as dist


def _exchange(tensor: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """All-to-all of rows: `input_splits[r]` rows go to rank r, `output_splits[r]` come from it."""
    output = tensor.new_empty((sum(output_splits), *tensor.shape[1:]))
    dist.all_to_all_single(output, tensor.contiguous(), output_splits, input_splits, group=group)
    return output


class AllToAll(torch.autograd.Function):
    """`_exchange` forward; the reverse exchange of the gradient backward."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _exchange(tensor, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        output_splits, input_splits = ctx.splits
        return _exchange(grad, input_splits, output_splits, ctx.group), None, None, None


COMPILE_VARIABLE = "BLOCKZOO_MOE_COMPILE"


def _compiling(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and os.environ.get(COMPILE_VARIABLE, "0") == "1"


@functools.cache
def _compiled(function):
    return torch.compile(function)


def compiled_piece(function, tensor: torch.Tensor):
    """`function`, through torch.compile where BLOCKZOO_MOE_COMPILE=1 and `tensor` is on CUDA."""
    return _compiled(function) if _compiling(tensor) else function


class ExpertOrder(NamedTuple):
    """The (token, expert) pairs sorted by expert; pair p = token · k + j is the token's j-th choice.

    `tokens[i]`: the token of sorted row i; `inverse[p]`: the sorted row of pair p; `sorted_experts[i]`: its expert;
    `counts[e]`: the rows of expert e. All on the device, computed without a host sync."""

    tokens: torch.Tensor
    inverse: torch.Tensor
    sorted_experts: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def of(cls, selected: torch.Tensor, experts: int) -> ExpertOrder:
        """From `selected` [tokens, k], each token's experts."""
        flat = selected.flatten()
        order = flat.argsort(stable=True)  # sorted row i holds pair order[i]
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=order.device))
        # Not bincount: on CUDA it reads the largest value back to the host.
        counts = flat.new_zeros(experts).scatter_add_(0, flat, torch.ones_like(flat))
        return cls(order // selected.shape[1], inverse, flat[order], counts)


def _gather_sum(rows: torch.Tensor, index: torch.Tensor, k: int) -> torch.Tensor:
    """Σ_j rows[index[t·k + j]] for every t: [len(index) / k, width]."""
    return rows.index_select(0, index).view(-1, k, rows.shape[-1]).sum(1)


def _weighted_gather_sum(rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_j weights[t, j] · rows[index[t·k + j]] for every t, accumulated in fp32: [len(weights), width]."""
    gathered = rows.index_select(0, index).view(*weights.shape, rows.shape[-1])
    return torch.bmm(weights.to(rows.dtype).unsqueeze(1), gathered).squeeze(1)


def _combine_backward(
    grad: torch.Tensor, outputs: torch.Tensor, tokens: torch.Tensor, sorted_scores: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad[tokens[i]] · sorted_scores[i], Σ_h grad[tokens[i], h] · outputs[i, h]) for every sorted row i, the
    dot products in fp32."""
    grad_rows = grad.index_select(0, tokens)
    return grad_rows * sorted_scores.to(grad.dtype).unsqueeze(-1), (grad_rows * outputs).sum(-1, dtype=torch.float32)


def gated(gate: torch.Tensor, up: torch.Tensor, activation) -> torch.Tensor:
    return activation(gate) * up


class Dispatch(torch.autograd.Function):
    """hidden[tokens]: the tokens' rows in the experts' order (each token k times). Backward: each token's gradient
    is the sum of its k rows', gathered through `inverse` (no scatter-add)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, tokens: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.k = k
        return hidden.index_select(0, tokens)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (inverse,) = ctx.saved_tensors
        return compiled_piece(_gather_sum, grad)(grad, inverse, ctx.k), None, None, None


class Combine(torch.autograd.Function):
    """Σ_j scores[t, j] · outputs[inverse[t·k + j]]: each token's k expert outputs (in the experts' order), weighted.
    Backward: the outputs' gradient is the token's gradient times the pair's score, and each score's gradient the
    dot product of the token's gradient with the pair's output; both gathered, in the outputs' order."""

    @staticmethod
    def forward(
        ctx, outputs: torch.Tensor, scores: torch.Tensor, tokens: torch.Tensor, inverse: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(outputs, scores, tokens, inverse)
        return compiled_piece(_weighted_gather_sum, outputs)(outputs, inverse, scores)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        outputs, scores, tokens, inverse = ctx.saved_tensors
        # The scores in the outputs' order: sorted row inverse[p] holds pair p.
        sorted_scores = torch.empty_like(scores.flatten()).index_copy_(0, inverse, scores.flatten())
        grad_outputs, dots = compiled_piece(_combine_backward, grad)(grad, outputs, tokens, sorted_scores)
        grad_scores = dots.index_select(0, inverse).view(scores.shape).to(scores.dtype)
        return grad_outputs, grad_scores, None, None


def products_on_expert_ranks(
    routed: torch.Tensor, counts: torch.Tensor, group, products, bias: torch.Tensor | None
) -> torch.Tensor:
    """Expert parallelism: each row of `routed` (sorted by expert, `counts` per global expert) goes to the rank of
    `group` holding its expert, where `products(rows, counts, experts)` runs that rank's experts over the rows that
    arrived (sorted by local expert) and `bias` [local experts, width] (or None) is added; each output comes back,
    in `routed`'s order."""
    sent = counts.view(group.size(), -1)
    local = sent.shape[1]
    received = torch.empty_like(sent)  # received[source, expert]: rows from rank `source` for local `expert`.
    dist.all_to_all_single(received, sent, group=group)
    send_splits, receive_splits = sent.sum(1).tolist(), received.sum(1).tolist()
    arrived = AllToAll.apply(routed, receive_splits, send_splits, group)
    # Arrived source-major; the products need the rows expert-major (a stable sort keeps the sources' order).
    arrived_experts = torch.arange(local, device=counts.device).repeat(group.size())
    arrived_experts = arrived_experts.repeat_interleave(received.flatten())
    order = arrived_experts.argsort(stable=True)
    outputs = products(arrived[order], received.sum(0), arrived_experts[order])
    if bias is not None:
        outputs = outputs + bias.to(outputs.dtype)[arrived_experts[order]]
    returned = torch.empty_like(outputs).index_copy(0, order, outputs)
    return AllToAll.apply(returned, send_splits, receive_splits, group)
