"""The forward's first kernel, `prepare_chunks` (see `triton_forward` for the others and the notation): per chunk and
value head, the within-chunk log decays b = cumsum(g), the strictly lower A[t, s] = β_t (k_t·k_s) e^{b_t − b_s}, its
inverse T = (I + A)⁻¹, and the WY factors W = T (β e^b K), U = T (β V).

T is made by forward substitution in blocks of 16 rows (exact for the unit lower-triangular system: no matrix powers
that lose precision): each diagonal block row by row, T_ii[r] = e_r − Σ_{s<r} A_ii[r, s] T_ii[s], then the blocks
below the diagonal, T_ij = −T_ii Σ_{j<=m<i} A_im T_mj. Two ways, chosen by IN_REGISTERS: in registers, the 16-row
blocks of A computed apart from their own rows of K; or in place, over the whole A stored in the output's memory.
Imports triton: import it only where Triton runs.
"""

import triton
import triton.language as tl

from blockzoo_gated_delta_net.triton_forward import (
    _chunk_rows,
    _decay_ratio,
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
    a barrier."""
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
def _row_block(k_pointer, g_pointer, beta_pointer, start, end, block, log_decay_before, heads, key_heads, head,
               key_size, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """k, β and b of a chunk's 16-row block `block` (b continuing from the chunk's log decays before it), and the
    log decay at its end. Rows past the document's end read k = β = g = 0."""
    SUB: tl.constexpr = SUBSTITUTION_BLOCK
    tokens = start + block * SUB + tl.arange(0, SUB)
    valid = tokens < end
    k = _load_rows(k_pointer, tokens, valid, key_heads, head // GROUP, key_size, BLOCK_K, 0)
    beta = _load_head_values(beta_pointer, tokens, valid, heads, head)
    b = log_decay_before + tl.cumsum(_load_head_values(g_pointer, tokens, valid, heads, head), 0)
    return k, beta, b, tl.sum(tl.where(tl.arange(0, SUB) == SUB - 1, b, 0.0), 0)


@triton.jit
def _lower_block(k_i, beta_i, b_i, k_j, b_j, DIAGONAL: tl.constexpr):
    """A_ij = β_i (k_i k_jᵀ) e^{b_i − b_j}, strictly lower on the diagonal (i = j); below it every row's token
    follows every column's, so no entry is masked."""
    products = tl.dot(k_i, tl.trans(k_j)) * beta_i[:, None]
    if DIAGONAL:
        return products * _decay_ratio(b_i, True, SUBSTITUTION_BLOCK)
    return products * tl.exp(b_i[:, None] - b_j[None, :])


@triton.jit
def _substitute_row(lower, inverse, r):
    """`inverse` with row r of a diagonal block's inverse made from the rows above it."""
    rows = tl.arange(0, SUBSTITUTION_BLOCK)
    a_row = tl.sum(tl.where(rows[:, None] == r, lower, 0.0), 0)  # A[r, :]
    new_row = tl.where(rows == r, 1.0, 0.0) - tl.sum(a_row[:, None] * inverse, 0)
    return tl.where(rows[:, None] == r, new_row[None, :], inverse)


@triton.jit
def _merge(a, t):
    return tl.dot(a, t, input_precision="ieee")


@triton.jit
def _invert_in_registers(k_pointer, g_pointer, beta_pointer, start, end, inverse_base, heads, key_heads, head,
                         key_size, GROUP: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """T of a chunk of 16, 32 or 64 rows stored at `inverse_base` ([CHUNK, CHUNK], row-major, zeros above the
    diagonal), every block of A and T held in registers (the four diagonal blocks substituted in one loop)."""
    SUB: tl.constexpr = SUBSTITUTION_BLOCK
    BLOCKS: tl.constexpr = CHUNK // SUB
    rows = tl.arange(0, SUB)
    identity = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    zero = tl.zeros([SUB, SUB], dtype=tl.float32)
    k0, beta0, b0, end0 = _row_block(k_pointer, g_pointer, beta_pointer, start, end, 0, 0.0, heads, key_heads,
                                     head, key_size, GROUP, BLOCK_K)  # fmt: skip
    a00 = _lower_block(k0, beta0, b0, k0, b0, True)
    t00 = identity
    t11 = identity
    t22 = identity
    t33 = identity
    if BLOCKS > 1:
        k1, beta1, b1, end1 = _row_block(k_pointer, g_pointer, beta_pointer, start, end, 1, end0, heads, key_heads,
                                         head, key_size, GROUP, BLOCK_K)  # fmt: skip
        a10 = _lower_block(k1, beta1, b1, k0, b0, False)
        a11 = _lower_block(k1, beta1, b1, k1, b1, True)
    if BLOCKS > 2:
        k2, beta2, b2, end2 = _row_block(k_pointer, g_pointer, beta_pointer, start, end, 2, end1, heads, key_heads,
                                         head, key_size, GROUP, BLOCK_K)  # fmt: skip
        k3, beta3, b3, _ = _row_block(k_pointer, g_pointer, beta_pointer, start, end, 3, end2, heads, key_heads,
                                      head, key_size, GROUP, BLOCK_K)  # fmt: skip
        a20 = _lower_block(k2, beta2, b2, k0, b0, False)
        a21 = _lower_block(k2, beta2, b2, k1, b1, False)
        a22 = _lower_block(k2, beta2, b2, k2, b2, True)
        a30 = _lower_block(k3, beta3, b3, k0, b0, False)
        a31 = _lower_block(k3, beta3, b3, k1, b1, False)
        a32 = _lower_block(k3, beta3, b3, k2, b2, False)
        a33 = _lower_block(k3, beta3, b3, k3, b3, True)
    for r in range(1, SUB):
        t00 = _substitute_row(a00, t00, r)
        if BLOCKS > 1:
            t11 = _substitute_row(a11, t11, r)
        if BLOCKS > 2:
            t22 = _substitute_row(a22, t22, r)
            t33 = _substitute_row(a33, t33, r)
    tl.store(_block_pointers(inverse_base, 0, 0, CHUNK), t00)
    if BLOCKS > 1:
        t10 = -_merge(t11, _merge(a10, t00))
        tl.store(_block_pointers(inverse_base, 0, 1, CHUNK), zero)
        tl.store(_block_pointers(inverse_base, 1, 0, CHUNK), t10)
        tl.store(_block_pointers(inverse_base, 1, 1, CHUNK), t11)
    if BLOCKS > 2:
        t21 = -_merge(t22, _merge(a21, t11))
        t32 = -_merge(t33, _merge(a32, t22))
        t20 = -_merge(t22, _merge(a20, t00) + _merge(a21, t10))
        t31 = -_merge(t33, _merge(a31, t11) + _merge(a32, t21))
        t30 = -_merge(t33, _merge(a30, t00) + _merge(a31, t10) + _merge(a32, t20))
        for j in tl.static_range(2, BLOCKS):
            tl.store(_block_pointers(inverse_base, 0, j, CHUNK), zero)
            tl.store(_block_pointers(inverse_base, 1, j, CHUNK), zero)
        tl.store(_block_pointers(inverse_base, 2, 3, CHUNK), zero)
        tl.store(_block_pointers(inverse_base, 2, 0, CHUNK), t20)
        tl.store(_block_pointers(inverse_base, 2, 1, CHUNK), t21)
        tl.store(_block_pointers(inverse_base, 2, 2, CHUNK), t22)
        tl.store(_block_pointers(inverse_base, 3, 0, CHUNK), t30)
        tl.store(_block_pointers(inverse_base, 3, 1, CHUNK), t31)
        tl.store(_block_pointers(inverse_base, 3, 2, CHUNK), t32)
        tl.store(_block_pointers(inverse_base, 3, 3, CHUNK), t33)


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
    w_pointer,  # out: W [tokens, heads, key_size] fp32
    u_pointer,  # out: U [tokens, heads, value_size] fp32
    heads,
    key_heads,
    key_size,
    value_size,
    GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    IN_REGISTERS: tl.constexpr,
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
    inverse_base = inverse_pointer + (chunk * heads + head).to(tl.int64) * CHUNK * CHUNK
    if IN_REGISTERS:
        start = tl.load(chunk_start_pointer + chunk).to(tl.int64)
        end = tl.load(chunk_end_pointer + chunk).to(tl.int64)
        _invert_in_registers(
            k_pointer, g_pointer, beta_pointer, start, end, inverse_base, heads, key_heads, head, key_size, GROUP,
            CHUNK, BLOCK_K,
        )  # fmt: skip
    else:
        tl.store(inverse_pointers, beta[:, None] * tl.dot(k, tl.trans(k)) * _decay_ratio(b, True, CHUNK))
        tl.debug_barrier()
        _invert_in_place(inverse_base, CHUNK)
    tl.debug_barrier()
    inverse = tl.load(inverse_pointers)

    w = tl.dot(inverse, k * (beta * tl.exp(b))[:, None])
    _store_rows(w_pointer, w, tokens, valid, heads, head, key_size, BLOCK_K, 0)
    for offset in range(0, value_size, BLOCK_V):
        v = _load_rows(v_pointer, tokens, valid, heads, head, value_size, BLOCK_V, offset)
        _store_rows(
            u_pointer, tl.dot(inverse, v * beta[:, None]), tokens, valid, heads, head, value_size, BLOCK_V, offset
        )
