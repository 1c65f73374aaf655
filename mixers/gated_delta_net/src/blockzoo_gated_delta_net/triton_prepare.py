"""The forward's first kernel, `prepare_chunks` (see `triton_forward` for the others and the notation): per chunk and
value head, the within-chunk log decays b = cumsum(g), the strictly lower A[t, s] = β_t (k_t·k_s) e^{b_t − b_s}, its
inverse T = (I + A)⁻¹, and the WY factors W = T (β e^b K), U = T (β V).

T is made by forward substitution in blocks of 16 rows (exact for the unit lower-triangular system: no matrix powers
that lose precision): each diagonal block row by row, T_ii[r] = e_r − Σ_{s<r} A_ii[r, s] T_ii[s], then the blocks
below the diagonal, T_ij = −T_ii Σ_{j<=m<i} A_im T_mj, in place over A stored in T's memory, where the backward reads
T (holding the blocks of A and T in registers instead timed slower on an H100). Imports triton: import it only where
Triton runs.
"""

import triton
import triton.language as tl

from blockzoo_gated_delta_net.triton_forward import (
    _chunk_rows,
    _decay_ratio,
    _dot,
    _inverse_pointers,
    _load_head_values,
    _load_rows,
    _store_head_values,
    _store_rows,
)

# The rows of the diagonal blocks inverted by substitution (tl.dot's smallest tile).
SUBSTITUTION_BLOCK = tl.constexpr(16)


@triton.jit
def _block_pointers(pointer, row_block, column_block, CHUNK: tl.constexpr):
    """Pointers of the [SUBSTITUTION_BLOCK, SUBSTITUTION_BLOCK] block (row_block, column_block) of a row-major
    [CHUNK, CHUNK] matrix."""
    SUB: tl.constexpr = SUBSTITUTION_BLOCK
    rows = tl.arange(0, SUB)
    return pointer + (row_block * SUB + rows[:, None]) * CHUNK + column_block * SUB + rows[None, :]


@triton.jit
def _invert_in_place(pointer, CHUNK: tl.constexpr):
    """T written over the strictly lower A at `pointer` ([CHUNK, CHUNK], row-major): first every diagonal block at
    once, then the blocks below the diagonal, block row by block row (products in full fp32). A row of blocks is
    written left to right over A's, which only the blocks to its right still read. The caller has stored A and passed
    a barrier; every write here is behind a barrier when it returns."""
    SUB: tl.constexpr = SUBSTITUTION_BLOCK
    BLOCKS: tl.constexpr = CHUNK // SUB
    block = tl.arange(0, BLOCKS)[:, None, None]
    rows = tl.arange(0, SUB)[None, :, None]
    columns = tl.arange(0, SUB)[None, None, :]
    diagonal = pointer + (block * SUB + rows) * CHUNK + block * SUB + columns
    lower = tl.load(diagonal)
    inverse = tl.zeros([BLOCKS, SUB, SUB], dtype=tl.float32)
    for r in range(SUB):
        a_row = tl.sum(tl.where(rows == r, lower, 0.0), 1)  # [BLOCKS, SUB]: row r of each diagonal block
        new_row = tl.where(columns == r, 1.0, 0.0) - tl.sum(a_row[:, :, None] * inverse, 1)[:, None, :]
        inverse = tl.where(rows == r, new_row, inverse)
    tl.store(diagonal, inverse)
    tl.debug_barrier()
    for i in tl.static_range(1, BLOCKS):
        diagonal_inverse = tl.load(_block_pointers(pointer, i, i, CHUNK))
        for j in tl.static_range(0, i):
            total = tl.zeros([SUB, SUB], dtype=tl.float32)
            for m in tl.static_range(j, i):
                a = tl.load(_block_pointers(pointer, i, m, CHUNK))
                t = tl.load(_block_pointers(pointer, m, j, CHUNK))
                total += tl.dot(a, t, input_precision="ieee")
            tl.debug_barrier()
            tl.store(_block_pointers(pointer, i, j, CHUNK), -tl.dot(diagonal_inverse, total, input_precision="ieee"))
            tl.debug_barrier()


@triton.jit
def prepare_chunks(
    k_pointer,
    v_pointer,
    g_pointer,
    beta_pointer,
    chunk_start_pointer,
    chunk_end_pointer,
    log_decay_pointer,  # out: b [tokens, heads] fp32
    inverse_pointer,  # out: T [chunks, heads, CHUNK, CHUNK] fp32
    w_pointer,  # out: W [tokens, heads, key_size] (the kept dtype, INTERMEDIATE_DTYPE)
    u_pointer,  # out: U [tokens, heads, value_size] (the kept dtype)
    heads,
    key_heads,
    key_size,
    value_size,
    GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    chunk, head = tl.program_id(0), tl.program_id(1)
    tokens, valid, _ = _chunk_rows(chunk_start_pointer, chunk_end_pointer, chunk, CHUNK)
    k = _load_rows(k_pointer, tokens, valid, key_heads, head // GROUP, key_size, BLOCK_K, 0)
    g = _load_head_values(g_pointer, tokens, valid, heads, head)
    beta = _load_head_values(beta_pointer, tokens, valid, heads, head)
    b = tl.cumsum(g, 0)
    _store_head_values(log_decay_pointer, b, tokens, valid, heads, head)

    # T is made in its place in memory, where the backward reads it.
    inverse_pointers = _inverse_pointers(inverse_pointer, chunk, heads, head, CHUNK)
    key_products = _dot(k, tl.trans(k), k_pointer.dtype.element_ty)
    tl.store(inverse_pointers, beta[:, None] * key_products * _decay_ratio(b, True, CHUNK))
    tl.debug_barrier()
    _invert_in_place(inverse_pointer + (chunk * heads + head).to(tl.int64) * CHUNK * CHUNK, CHUNK)
    inverse = tl.load(inverse_pointers)

    kept: tl.constexpr = w_pointer.dtype.element_ty
    w = _dot(inverse, k * (beta * tl.exp(b))[:, None], kept)
    _store_rows(w_pointer, w, tokens, valid, heads, head, key_size, BLOCK_K, 0)
    for offset in range(0, value_size, BLOCK_V):
        v = _load_rows(v_pointer, tokens, valid, heads, head, value_size, BLOCK_V, offset)
        u = _dot(inverse, v * beta[:, None], kept)
        _store_rows(u_pointer, u, tokens, valid, heads, head, value_size, BLOCK_V, offset)
