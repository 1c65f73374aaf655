"""blockzoo's own Triton kernels of the chunked gated delta rule, forward and backward, as one autograd function.

`triton_gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial)` takes q and k already L2-normalised (q scaled),
per key head [tokens, key_heads, key_size]; v [tokens, value_heads, value_size]; g the log decay and beta
[tokens, value_heads]; the packed documents' cu_seqlens; optionally each document's initial state [documents,
value_heads, key_size, value_size]. It returns (o in v's dtype, the final states in fp32); both are differentiable,
and so are all inputs. Kernels: `triton_forward` and `triton_backward`. The forward keeps, for the backward, each
chunk's starting state, T = (I + A)⁻¹ (fp32), W and u (in INTERMEDIATE_DTYPE for 16-bit inputs, fp32 for fp32
ones; the state pass is not recomputed).

Imports triton: import this module only on CUDA or under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton

from blockzoo_gated_delta_net.triton_backward import (
    chunk_key_gradients,
    chunk_new_value_gradients,
    chunk_wy_gradients,
    pass_state_gradients,
)
from blockzoo_gated_delta_net.triton_forward import chunk_outputs, pass_states
from blockzoo_gated_delta_net.triton_prepare import prepare_chunks

CHUNK_SIZE = 64
# Head sizes the kernels take: the forward's kernels hold a whole key head in one block (tl.dot wants >= 16 channels);
# their shared memory is sized and checked for Hopper (227 KiB) at 128 key channels, the most they take.
MAX_KEY_SIZE = 128
MIN_HEAD_SIZE = 16
# The fewest channels a block of the per-chunk kernels takes, smaller heads masked. With blocks of 16 or 32 channels
# their bf16 products gave wrong gradients on an H100 (Triton 3.6; right ones under the interpreter), while the
# blocks of 64 that heads of 128 take matched float64: small heads take those too (the GPU tests pass with them on an
# H100). The state passes keep blocks of a head's size (right on the GPU down to 16).
MIN_BLOCK = 64
# Launch options, chosen by timing on an H100 (4 documents × 4096 tokens of 16 heads × 128; `benchmarks/gdn_kernel.py
# --launches` times others, benchmarks/RESULTS.md keeps the figures) and checked against Hopper's shared memory in the
# tests (227 KiB a block, 228 a multiprocessor). The per-chunk kernels run one program per chunk and head and are bound
# by latency, not bandwidth: few warps let more programs share a multiprocessor, and blocks of CHUNK_VALUE_BLOCK value
# channels halve their loops against 32. The state passes run one program per document, head and block of VALUE_BLOCK
# value channels: small blocks give more programs (256 there: two to a multiprocessor with two stages of loads, one
# wave). The backward's per-chunk gradients take blocks of KEY_BLOCK key channels: a whole key head of 128 needed
# 214 KiB of shared memory, one program to a multiprocessor.
PREPARE_OPTIONS = {"num_warps": 2, "num_stages": 2}
CHUNK_OPTIONS = {"num_warps": 4, "num_stages": 2}
STATE_PASS_OPTIONS = {"num_warps": 4, "num_stages": 2}
CHUNK_GRADIENT_OPTIONS = {"num_warps": 4, "num_stages": 3}
WY_GRADIENT_OPTIONS = {"num_warps": 4, "num_stages": 1}
VALUE_BLOCK = 32
CHUNK_VALUE_BLOCK = 64
KEY_BLOCK = 64
# The dtype of what the kernels keep between them: W, U, each chunk's state and the new values u of the forward, and
# the backward's gradients of each chunk's state, of u and of W; the dots that read them, and T's products in the
# backward, take their operands in it (every kernel accumulates in fp32 and carries the state and its gradient in
# fp32 from chunk to chunk). bf16, flash-linear-attention's choice: it halves the memory traffic and shared memory of
# the latency-bound kernels that read them and runs their dots at bf16's rate, while the largest relative error
# against float64 stays fla's (3.9e-3 at the benchmark's shape). Inputs of more precision (fp32 training) keep their
# own. `--launches intermediates=fp32` times fp32.
INTERMEDIATE_DTYPE = torch.bfloat16


def _block(size: int, limit: int = MAX_KEY_SIZE) -> int:
    return max(MIN_HEAD_SIZE, min(limit, triton.next_power_of_2(size)))


def supports(key_size: int, value_size: int, chunk_size: int = CHUNK_SIZE) -> bool:
    """Whether the kernels take these head sizes and chunks (powers of two from 16 to 64 tokens: larger ones would
    not fit the per-chunk kernels' shared memory)."""
    chunks_fit = chunk_size in (16, 32, 64)
    return chunks_fit and MIN_HEAD_SIZE <= key_size <= MAX_KEY_SIZE and value_size >= MIN_HEAD_SIZE


def chunk_layout(cu_seqlens: torch.Tensor, chunk_size: int, tokens: int) -> tuple[torch.Tensor, ...]:
    """(first token, end token) of every chunk of every document, documents in order, and each document's first
    chunk index [documents + 1]. An empty document has no chunk.

    Computed on the device without reading anything back (CUDA graphs capture it; `training.cuda_graphs` replays
    batches of one shape with other lengths): the chunk slots number a bound known from the shape,
    tokens // chunk_size + documents >= Σ ceil(length / chunk_size); the slots past the last chunk are empty
    (first token = end token), and the kernels write nothing for them."""
    cu_seqlens = cu_seqlens.to(torch.int64)
    documents = len(cu_seqlens) - 1
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    chunks = (lengths + chunk_size - 1) // chunk_size
    chunk_offsets = torch.cat([chunks.new_zeros(1), chunks.cumsum(0)])
    slots = torch.arange(tokens // chunk_size + documents, device=cu_seqlens.device)
    document = torch.searchsorted(chunk_offsets[1:], slots, right=True).clamp(max=max(documents - 1, 0))
    within = slots - chunk_offsets[document]
    starts = cu_seqlens[document] + within * chunk_size
    ends = torch.minimum(starts + chunk_size, cu_seqlens[document + 1])
    used = slots < chunk_offsets[-1]
    starts, ends = torch.where(used, starts, 0), torch.where(used, ends, 0)
    return starts.to(torch.int32), ends.to(torch.int32), chunk_offsets.to(torch.int32)


class TritonGatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial, cu_seqlens, chunk_size):
        tokens, key_heads, key_size = q.shape
        heads, value_size = v.shape[1:]
        documents = len(cu_seqlens) - 1
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        starts, ends, chunk_offsets = chunk_layout(cu_seqlens, chunk_size, tokens)
        chunks = len(starts)
        sizes = {"heads": heads, "key_heads": key_heads, "key_size": key_size, "value_size": value_size}
        # The state passes' blocks (one program for each block of value channels), and the per-chunk kernels'.
        blocks = {
            "GROUP": heads // key_heads, "CHUNK": chunk_size, "BLOCK_K": _block(key_size),
            "BLOCK_V": _block(value_size, VALUE_BLOCK),
        }  # fmt: skip
        chunk_blocks = blocks | {
            "BLOCK_K": max(MIN_BLOCK, blocks["BLOCK_K"]),
            "BLOCK_V": max(MIN_BLOCK, _block(value_size, CHUNK_VALUE_BLOCK)),
        }
        fp32 = {"dtype": torch.float32, "device": q.device}

        log_decay = torch.empty(tokens, heads, **fp32)
        inverse = torch.empty(chunks, heads, chunk_size, chunk_size, **fp32)
        # Never less precise than the inputs: fp32 inputs keep fp32 (TF32 products), the accuracy a run in fp32 wants.
        kept = {"dtype": torch.promote_types(INTERMEDIATE_DTYPE, v.dtype), "device": q.device}
        w = torch.empty(tokens, heads, key_size, **kept)
        u = torch.empty(tokens, heads, value_size, **kept)
        if chunks:
            prepare_chunks[(chunks, heads)](
                k, v, g, beta, starts, ends, log_decay, inverse, w, u, **sizes, **chunk_blocks, **PREPARE_OPTIONS
            )

        final = torch.empty(documents, heads, key_size, value_size, **fp32)
        states = torch.empty(chunks, heads, key_size, value_size, **kept)
        new_values = torch.empty(tokens, heads, value_size, **kept)
        cu_seqlens = cu_seqlens.to(torch.int32)
        has_initial = initial is not None
        initial_tensor = initial.contiguous() if has_initial else final  # not read without an initial state
        grid = (documents, heads, triton.cdiv(value_size, blocks["BLOCK_V"]))
        if documents:
            pass_states[grid](
                k, w, u, log_decay, initial_tensor, cu_seqlens, chunk_offsets, final, states, new_values,
                **sizes, HAS_INITIAL=has_initial, **blocks, **STATE_PASS_OPTIONS,
            )  # fmt: skip
        output = torch.empty_like(v)
        if chunks:
            chunk_outputs[(chunks, heads)](
                q, k, log_decay, states, new_values, starts, ends, output, **sizes, **chunk_blocks, **CHUNK_OPTIONS
            )
        ctx.save_for_backward(
            q, k, v, beta, log_decay, inverse, w, states, new_values, cu_seqlens, starts, ends, chunk_offsets
        )
        initial_dtype = initial.dtype if has_initial else None
        ctx.settings = (sizes, blocks, chunk_blocks, has_initial, initial_dtype, g.dtype, beta.dtype)
        return output, final

    @staticmethod
    def backward(ctx, output_gradient, final_gradient):
        q, k, v, beta, log_decay, inverse, w, states, new_values, cu_seqlens, starts, ends, chunk_offsets = (
            ctx.saved_tensors
        )
        sizes, blocks, chunk_blocks, has_initial, initial_dtype, g_dtype, beta_dtype = ctx.settings
        tokens, heads, value_size = v.shape
        key_heads, key_size = q.shape[1:]
        documents, chunks = len(cu_seqlens) - 1, len(starts)
        fp32 = {"dtype": torch.float32, "device": q.device}
        output_gradient = torch.zeros_like(v) if output_gradient is None else output_gradient.contiguous()
        has_final_gradient = final_gradient is not None
        kept = {"dtype": states.dtype, "device": q.device}  # the forward's
        state_gradients = torch.empty(states.shape, **kept)
        new_value_gradients = torch.empty(tokens, heads, value_size, **kept)
        initial_gradient = torch.empty(documents, heads, key_size, value_size, **fp32)
        if chunks:
            chunk_new_value_gradients[(chunks, heads)](
                q, k, log_decay, output_gradient, starts, ends, new_value_gradients, **sizes, **chunk_blocks,
                **CHUNK_OPTIONS,
            )  # fmt: skip
        grid = (documents, heads, triton.cdiv(value_size, blocks["BLOCK_V"]))
        if documents:
            pass_state_gradients[grid](
                q, k, w, log_decay, output_gradient,
                final_gradient.contiguous() if has_final_gradient else initial_gradient,
                cu_seqlens, chunk_offsets, state_gradients, new_value_gradients, initial_gradient,
                **sizes, HAS_FINAL_GRADIENT=has_final_gradient, **blocks, **STATE_PASS_OPTIONS,
            )  # fmt: skip
        # Value head h reads key head h // group: a key head's gradient is the sum over its group. With one value head
        # a key head, q's and k's gradients need no sum and are written in their dtype (k's last kernel adds its part
        # to the fp32 one of the kernel before). Every token lies in a chunk: the kernels write every row.
        group = heads // key_heads
        summed_dtype = q.dtype if group == 1 else torch.float32
        q_gradient = torch.empty(tokens, heads, key_size, dtype=summed_dtype, device=q.device)
        k_gradient_part = torch.empty(tokens, heads, key_size, **fp32)
        k_gradient = torch.empty(tokens, heads, key_size, dtype=summed_dtype, device=q.device)
        w_gradient = torch.empty(tokens, heads, key_size, **kept)
        v_gradient = torch.empty_like(v)
        beta_gradient = torch.empty(tokens, heads, **fp32)
        g_gradient = torch.empty(tokens, heads, **fp32)
        key_block = min(KEY_BLOCK, chunk_blocks["BLOCK_K"])
        key_blocks = triton.cdiv(key_size, key_block)
        b_gradient_parts = torch.empty(key_blocks, tokens, heads, **fp32)
        if chunks:
            chunk_key_gradients[(chunks, heads, key_blocks)](
                q, k, log_decay, states, new_values, output_gradient, state_gradients, new_value_gradients, starts,
                ends, q_gradient, k_gradient_part, w_gradient, b_gradient_parts, tokens, **sizes,
                **(chunk_blocks | {"BLOCK_K": key_block}), **CHUNK_GRADIENT_OPTIONS,
            )  # fmt: skip
            chunk_wy_gradients[(chunks, heads)](
                k, v, beta, log_decay, inverse, new_value_gradients, w_gradient, b_gradient_parts, starts, ends,
                k_gradient_part, k_gradient, v_gradient, beta_gradient, g_gradient, tokens, **sizes,
                **(chunk_blocks | {"BLOCK_K": key_block}), **WY_GRADIENT_OPTIONS,
            )  # fmt: skip
        q_gradient, k_gradient = (
            (x if group == 1 else x.view(tokens, key_heads, group, key_size).sum(2)).to(q.dtype)
            for x in (q_gradient, k_gradient)
        )
        return (
            q_gradient,
            k_gradient,
            v_gradient,
            g_gradient.to(g_dtype),
            beta_gradient.to(beta_dtype),
            initial_gradient.to(initial_dtype) if has_initial else None,
            None,
            None,
        )


def triton_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial: torch.Tensor | None = None,
    *,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [tokens, value_heads, value_size] in v's dtype, final states [documents, value_heads, key_size,
    value_size] fp32) of the gated delta rule over the packed documents (see the module's docstring)."""
    if not supports(q.shape[-1], v.shape[-1], chunk_size):
        raise ValueError(
            f"triton_gated_delta_rule: head sizes {q.shape[-1]} (key) and {v.shape[-1]} (value) and chunks of "
            f"{chunk_size} tokens are outside [{MIN_HEAD_SIZE}, {MAX_KEY_SIZE}] (key), >= {MIN_HEAD_SIZE} (value) and "
            "16, 32 or 64 tokens"
        )
    return TritonGatedDeltaRule.apply(q, k, v, g, beta, initial, cu_seqlens, chunk_size)
