"""A fused cross-entropy chunk's elementwise part as one Triton kernel: the log-sum-exp and target logit of each row
of the compute-dtype logits, and the gradient softmax − one-hot written over the logits themselves.

One program per row reads the row twice, once for the log-sum-exp (an online maximum and sum over blocks of
columns) and once to write the gradient: two reads and one write of the logits, the least a row too long for one
program's registers allows, and no new `[tokens, vocabulary]` tensor. The second pass walks the row backwards and
the first asks the cache to keep what it read, so that the second finds the row's end, read last, still in L2.
`blockzoo.layers.cross_entropy` takes it for a single process's chunks on CUDA, where it beats torch.compile of the
plain code (`kernel="compiled"` or BLOCKZOO_CROSS_ENTROPY_KERNEL=compiled chooses that instead). Runs on CPU tensors
under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns a program reads at once, and its warps: 16 bf16 values a thread, loaded as two 16-byte vectors. Larger
# blocks (8192 × 16, 16384 × 32: fewer rows in flight) timed within 1 % of this on an H100 (benchmarks/kernels.py).
BLOCK = 4096
WARPS = 8


@triton.jit
def _loss_and_gradient_kernel(
    logits_pointer,
    row_stride,
    columns,
    targets_pointer,
    labelled_pointer,
    lse_pointer,
    target_logit_pointer,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_pointer = logits_pointer + row * row_stride
    offsets = tl.arange(0, BLOCK)

    maximum = float("-inf")
    total = 0.0
    for start in range(0, columns, BLOCK):
        block = start + offsets
        values = tl.load(row_pointer + block, mask=block < columns, other=float("-inf"), eviction_policy="evict_last")
        values = values.to(tl.float32)
        new_maximum = tl.maximum(maximum, tl.max(values, 0))
        total = total * tl.exp(maximum - new_maximum) + tl.sum(tl.exp(values - new_maximum), 0)
        maximum = new_maximum
    lse = maximum + tl.log(total)

    target = tl.load(targets_pointer + row)  # -1: none among these columns
    target_logit = tl.load(row_pointer + tl.maximum(target, 0)).to(tl.float32)
    tl.store(lse_pointer + row, lse)
    tl.store(target_logit_pointer + row, tl.where(target >= 0, target_logit, 0.0))

    # exp(x − inf) = 0: an ignored token's row of the gradient is zero.
    shift = tl.where(tl.load(labelled_pointer + row), lse, float("inf"))
    blocks = tl.cdiv(columns, BLOCK)
    for index in range(0, blocks):
        block = (blocks - 1 - index) * BLOCK + offsets
        inside = block < columns
        values = tl.load(row_pointer + block, mask=inside, other=0.0, eviction_policy="evict_first").to(tl.float32)
        gradient = tl.exp(values - shift) - (block == target).to(tl.float32)
        tl.store(row_pointer + block, gradient.to(logits_pointer.dtype.element_ty), mask=inside)


def loss_and_gradient(
    logits: torch.Tensor,
    targets: torch.Tensor,
    labelled: torch.Tensor,
    *,
    block: int | None = None,
    warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp32 log-sum-exp of each row, the row's target logit or 0 where its target is -1, the gradient) of `logits`
    `[tokens, columns]`, as `cross_entropy._loss_and_gradient` computes them; the gradient (softmax − one-hot, zero
    for a row not `labelled`) is written over `logits`, which is returned. `block`, `warps`: the launch's (default
    BLOCK and WARPS)."""
    if logits.ndim != 2 or logits.stride(1) != 1:
        raise ValueError(f"the logits must be a matrix of contiguous rows, got shape {tuple(logits.shape)}")
    rows, columns = logits.shape
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    target_logit = torch.empty_like(lse)
    if rows:
        _loss_and_gradient_kernel[(rows,)](
            logits,
            logits.stride(0),
            columns,
            targets.contiguous(),
            labelled.contiguous(),
            lse,
            target_logit,
            BLOCK=min(block or BLOCK, triton.next_power_of_2(columns)),
            num_warps=warps or WARPS,
        )
    return lse, target_logit, logits
