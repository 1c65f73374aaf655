"""The attention kernels over packed documents, and the one place that chooses between them.

Every kernel computes, for each query token, softmax(scale · q·k) · v over the keys it may see: keys
of the same document, at positions ≤ its own (causal), and within `window` positions of it (itself
included). Queries and keys are packed `[tokens, heads, head_size]`; keys may hold fewer heads (GQA:
query head h uses key head h // (heads / key_heads)). Queries and keys are described by `Segments`
that may differ (generation: the keys are the cache's, the queries the new tokens).

- `torch`: SDPA with a dense block-diagonal mask. Runs anywhere; the reference the others are tested against.
- `varlen`: torch's flash `varlen_attn` (CUDA, bf16/fp16, torch ≥ 2.11 for windows).
- `batched`: `varlen`, but documents of one length (no window) go through SDPA as `[documents, heads, length,
  head_size]`.
- `flex`: FlexAttention with a document mask (compiled on CUDA; forward only on CPU).

`auto` picks, on CUDA, batched where it can run (bf16/fp16), else torch; on the CPU, torch. Measured on an H200
(`benchmarks/attention_kernels.py`, bf16, forward+backward of 8-16k packed tokens): varlen 1.4-2.2 ms and flex
within 20% of it, torch's masked SDPA 13-21x slower; flex also spends 8-13 ms building each batch's block mask,
so `auto` never picks flex; it stays selectable with `implementation: flex` (decoding steps then use `auto`).
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from blockzoo.api import Batch


class Segments(NamedTuple):
    """Where the documents lie along a packed token dim."""

    cu_seqlens: torch.Tensor  # int32, [documents + 1]
    max_length: int
    document_index: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens], position of each token in its document

    @classmethod
    def of(cls, batch: Batch) -> Segments:
        return cls(batch.cu_seqlens, batch.max_length, batch.document_index, batch.positions)

    @classmethod
    def from_lengths(cls, lengths: torch.Tensor) -> Segments:
        cu_seqlens = F.pad(lengths.cumsum(0), (1, 0))
        document_index = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
        positions = torch.arange(int(cu_seqlens[-1]), device=lengths.device) - cu_seqlens[document_index]
        return cls(cu_seqlens.to(torch.int32), int(lengths.max()), document_index, positions)


def allowed(queries: Segments, keys: Segments, causal: bool, window: int | None) -> Callable:
    """`mask(query_index, key_index)`: may that query see that key? (Indices into the packed token dims.)"""

    def mask(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        result = queries.document_index[query] == keys.document_index[key]
        if causal:
            distance = queries.positions[query] - keys.positions[key]
            result = result & (distance >= 0)
            if window is not None:
                result = result & (distance < window)
        return result

    return mask


class TorchKernel:
    """SDPA with a dense mask, over chunks of whole documents when queries and keys are the same tokens
    (training), so a micro-batch of many sequences costs about one mask per sequence, not one for all."""

    name = "torch"
    chunk_tokens = 512  # Documents are grouped into chunks of about this many tokens (more for a longer one).

    def unavailable(self, query: torch.Tensor) -> str | None:
        return None

    def prepare(
        self, queries: Segments, keys: Segments, causal: bool, window: int | None
    ) -> list[tuple[slice, slice, torch.Tensor]]:
        """(query slice, key slice, mask) of each chunk."""
        mask = allowed(queries, keys, causal, window)
        if queries is keys:
            bounds = _chunk_bounds(queries.cu_seqlens.tolist(), max(self.chunk_tokens, queries.max_length))
            chunks = [(slice(start, end), slice(start, end)) for start, end in bounds]
        else:
            chunks = [(slice(0, len(queries.positions)), slice(0, len(keys.positions)))]
        device = queries.positions.device
        return [
            (
                rows,
                columns,
                mask(
                    torch.arange(rows.start, rows.stop, device=device)[:, None],
                    torch.arange(columns.start, columns.stop, device=device)[None, :],
                ),
            )
            for rows, columns in chunks
        ]

    def attend(self, query, key, value, chunks: list[tuple[slice, slice, torch.Tensor]], scale: float) -> torch.Tensor:
        key, value = (_repeat_heads(tensor, query.shape[1]).transpose(0, 1) for tensor in (key, value))
        query = query.transpose(0, 1)
        # A batch dim of one: on the CPU, SDPA runs its fused (flash) kernel for 4-D inputs only, for 3-D its math
        # path, which materializes the scores and the masked softmax (several times slower, benchmarks/RESULTS.md).
        outputs = [
            F.scaled_dot_product_attention(
                query[None, :, rows], key[None, :, columns], value[None, :, columns], attn_mask=mask, scale=scale
            )[0]
            for rows, columns, mask in chunks
        ]
        return torch.cat(outputs, dim=1).transpose(0, 1)


def _chunk_bounds(cu_seqlens: list[int], limit: int) -> list[tuple[int, int]]:
    """Consecutive runs of whole documents of at most `limit` tokens (a longer document is a run of its own)."""
    bounds, start = [], 0
    for previous, end in itertools.pairwise(cu_seqlens[1:]):
        if end - start > limit:
            bounds.append((start, previous))
            start = previous
    return [*bounds, (start, cu_seqlens[-1])]


class VarlenKernel:
    name = "varlen"

    def unavailable(self, query: torch.Tensor) -> str | None:
        if _VARLEN_ATTN is None:
            return f"torch {torch.__version__} has no torch.nn.attention.varlen"
        if "window_size" not in _VARLEN_PARAMETERS:
            return f"torch {torch.__version__}'s varlen_attn takes no window_size (torch >= 2.11 does)"
        if query.device.type != "cuda":
            return "it needs CUDA"
        if query.dtype not in (torch.bfloat16, torch.float16):
            return f"flash kernels need bf16 or fp16 activations, got {query.dtype}"
        if query.shape[-1] % 8 or query.shape[-1] > 256:
            return f"flash kernels need a head_size that is a multiple of 8 up to 256, got {query.shape[-1]}"
        return None

    def prepare(self, queries: Segments, keys: Segments, causal: bool, window: int | None) -> dict[str, Any]:
        # Flash aligns causal masks bottom-right: the last query of a document sees its last key (KV cache).
        left = -1 if window is None else window - 1
        return {
            "cu_seq_q": queries.cu_seqlens,
            "cu_seq_k": keys.cu_seqlens,
            "max_q": queries.max_length,
            "max_k": keys.max_length,
            "window_size": (left, 0) if causal else (-1, -1),
        }

    def attend(self, query, key, value, prepared: dict[str, Any], scale: float) -> torch.Tensor:
        options = dict(prepared)
        if "enable_gqa" in _VARLEN_PARAMETERS:
            options["enable_gqa"] = key.shape[1] != query.shape[1]
        else:
            key, value = (_repeat_heads(tensor, query.shape[1]) for tensor in (key, value))
        if "scale" in _VARLEN_PARAMETERS:
            options["scale"] = scale
        else:  # The kernel's own scale is head_size**-0.5.
            query = query * (scale * query.shape[-1] ** 0.5)
        # Key and value may be strided views of the key‖value projection.
        query, key, value = (tensor.contiguous() for tensor in (query, key, value))
        return _VARLEN_ATTN(query, key, value, **options)


class BatchedKernel(VarlenKernel):
    """`varlen`, except when every document has one length, no window and queries and keys are the same tokens
    (training on unpacked rows): then torch SDPA over `[documents, heads, length, head_size]`, where torch picks its
    fastest fused kernel for the shape (cuDNN's on Hopper) rather than flash's varlen one."""

    name = "batched"

    def prepare(self, queries: Segments, keys: Segments, causal: bool, window: int | None) -> dict[str, Any]:
        documents = len(queries.cu_seqlens) - 1
        if queries is keys and window is None and documents * queries.max_length == len(queries.positions):
            return {"documents": documents, "causal": causal}
        return super().prepare(queries, keys, causal, window)

    def attend(self, query, key, value, prepared: dict[str, Any], scale: float) -> torch.Tensor:
        if "documents" not in prepared:
            return super().attend(query, key, value, prepared, scale)
        rows = [tensor.unflatten(0, (prepared["documents"], -1)).transpose(1, 2) for tensor in (query, key, value)]
        output = F.scaled_dot_product_attention(
            *rows, is_causal=prepared["causal"], scale=scale, enable_gqa=key.shape[1] != query.shape[1]
        )
        return output.transpose(1, 2).flatten(0, 1)


class FlexKernel:
    """FlexAttention with a document mask. Token counts are padded to a multiple of its block size: torch 2.11's
    compiled kernel failed to build for other lengths (NoValidChoicesError); padded rows and columns see nothing."""

    name = "flex"
    block = 128

    def unavailable(self, query: torch.Tensor) -> str | None:
        return None if _flex_attention() is not None else f"torch {torch.__version__} has no FlexAttention"

    def prepare(self, queries: Segments, keys: Segments, causal: bool, window: int | None) -> Any:
        from torch.nn.attention.flex_attention import create_block_mask

        # Padding tokens belong to no document (-1 for queries, -2 for keys), so no query sees a padding key.
        queries, keys = _padded(queries, self.block, -1), _padded(keys, self.block, -2)
        mask = allowed(queries, keys, causal, window)
        return create_block_mask(
            lambda batch, head, query, key: mask(query, key),
            None,
            None,
            len(queries.positions),
            len(keys.positions),
            device=queries.positions.device,
        )

    def attend(self, query, key, value, block_mask: Any, scale: float) -> torch.Tensor:
        flex_attention = _flex_attention()
        if query.is_cuda:
            flex_attention = _compiled(flex_attention)
        tokens = len(query)
        query, key, value = (_pad_tokens(tensor, self.block).transpose(0, 1)[None] for tensor in (query, key, value))
        output = flex_attention(
            query, key, value, block_mask=block_mask, scale=scale, enable_gqa=key.shape[1] != query.shape[1]
        )
        return output[0].transpose(0, 1)[:tokens]


def _pad_tokens(tensor: torch.Tensor, multiple: int) -> torch.Tensor:
    return F.pad(tensor, (0, 0, 0, 0, 0, -len(tensor) % multiple))


def _padded(segments: Segments, multiple: int, document: int) -> Segments:
    padding = -len(segments.positions) % multiple
    return segments._replace(
        document_index=F.pad(segments.document_index, (0, padding), value=document),
        positions=F.pad(segments.positions, (0, padding)),
    )


KERNELS = {kernel.name: kernel for kernel in (TorchKernel(), VarlenKernel(), BatchedKernel(), FlexKernel())}
# What `auto` tries, in order, on each device type.
AUTO_ORDER = {"cuda": ("batched", "torch")}
DEFAULT_ORDER = ("torch",)


def select_kernel(implementation: str, query: torch.Tensor) -> TorchKernel | VarlenKernel | FlexKernel:
    """The kernel for `implementation` (a config value) on `query`'s device and dtype; an error if it cannot run."""
    if implementation == "auto":
        for name in AUTO_ORDER.get(query.device.type, DEFAULT_ORDER):
            if KERNELS[name].unavailable(query) is None:
                return KERNELS[name]
        raise RuntimeError("no attention kernel can run here")  # Unreachable: torch runs anywhere.
    kernel = KERNELS[implementation]
    if (reason := kernel.unavailable(query)) is not None:
        raise RuntimeError(f"attention implementation {implementation!r} cannot run here: {reason}")
    return kernel


def _repeat_heads(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """`[tokens, key_heads, size]` → `[tokens, heads, size]`, each key head serving consecutive query heads."""
    return tensor if tensor.shape[1] == heads else tensor.repeat_interleave(heads // tensor.shape[1], dim=1)


def _find_varlen_attn() -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


# Looked up once at import, not in the forward: a compiled block would trace the lookup (and `inspect`) each time.
_VARLEN_ATTN = _find_varlen_attn()
# The keyword arguments of this torch's varlen_attn (they grew from 2.10 to 2.11).
_VARLEN_PARAMETERS = frozenset(() if _VARLEN_ATTN is None else inspect.signature(_VARLEN_ATTN).parameters)


@functools.cache
def _flex_attention() -> Callable | None:
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return None
    return flex_attention


@functools.cache
def _compiled(function: Callable) -> Callable:
    # Static shapes: torch 2.11's kernel for dynamic shapes failed to build (NoValidChoicesError). A training run
    # has one token count per micro-batch, so it compiles once.
    return torch.compile(function, dynamic=False)
