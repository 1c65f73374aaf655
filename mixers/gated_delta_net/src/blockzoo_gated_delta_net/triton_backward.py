"""The chunked gated delta rule's backward pass as Triton kernels (the forward's notation, `triton_forward`).

Per chunk, with S its starting state, S' the next, u = U − W S, O = (e^b Q) S + P u with P = (Q Kᵀ) ⊙ Γ and
S' = e^{b_C} S + (K ⊙ e^{b_C − b})ᵀ u, the gradients dO and dS' give:

- `chunk_new_value_gradients` (one program per chunk and value head, all chunks at once): the part of du that
  needs no later chunk, Pᵀ dO.
- `pass_state_gradients` (one program per document, value head and block of value channels; sequential, last chunk
  first, from the gradient of the final state): du = Pᵀ dO + (K ⊙ e^{b_C − b}) dS' and
  dS = (e^b Q)ᵀ dO + e^{b_C} dS' − Wᵀ du; it keeps each chunk's dS' and du, and writes the initial state's gradient.
- `chunk_key_gradients` (one program per chunk, value head and block of key channels, all chunks at once): with
  dP = dO uᵀ, dW = −du Sᵀ, the gradients of q and k through O and S' (per value head; the caller sums a key head's
  group), dW, and each key block's part of the gradient of b (the decays appear as e^{b_t − b_s}: +row sums −column
  sums; every such term is a sum over key channels). Blocks of key channels keep its tiles small: with whole key
  heads of 128 one program needed most of a multiprocessor's shared memory and its loads could not overlap.
- `chunk_wy_gradients` (one program per chunk and value head, all chunks at once, after it; key channels in blocks
  too): through the WY factors, dU = du, dT = dU (βV)ᵀ + dW (β e^b K)ᵀ and dA = −Tᵀ dT Tᵀ (below the diagonal), the
  gradients of v and β, k's remaining part, and dg = the reverse cumulative sum within the chunk of db (the key
  blocks' parts and its own).
"""

import triton
import triton.language as tl

from blockzoo_gated_delta_net.triton_forward import (
    _chunk_rows,
    _chunk_scores,
    _decay_ratio,
    _document_chunks,
    _dot,
    _inverse_pointers,
    _load_head_values,
    _load_log_decays,
    _load_rows,
    _load_state,
    _load_tile,
    _read_chunk,
    _state_pointers,
    _store_head_values,
    _store_rows,
    _store_state,
)


@triton.jit
def chunk_new_value_gradients(
    q_pointer,
    k_pointer,
    log_decay_pointer,
    output_gradient_pointer,
    chunk_start_pointer,
    chunk_end_pointer,
    new_value_gradients_pointer,  # out: Pᵀ dO [tokens, heads, value_size] (the kept dtype), completed later
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
    tokens, valid, _, _, scores = _chunk_scores(
        q_pointer, k_pointer, log_decay_pointer, chunk_start_pointer, chunk_end_pointer, chunk, heads, key_heads,
        head, key_size, GROUP, CHUNK, BLOCK_K,
    )  # fmt: skip
    for offset in range(0, value_size, BLOCK_V):
        output_gradient = _load_tile(output_gradient_pointer, tokens, valid, heads, head, value_size, BLOCK_V, offset)
        within = _dot(tl.trans(scores), output_gradient, new_value_gradients_pointer.dtype.element_ty)
        _store_rows(new_value_gradients_pointer, within, tokens, valid, heads, head, value_size, BLOCK_V, offset)


@triton.jit
def pass_state_gradients(
    q_pointer,
    k_pointer,
    w_pointer,
    log_decay_pointer,
    output_gradient_pointer,
    final_gradient_pointer,
    cu_seqlens_pointer,
    chunk_offsets_pointer,
    state_gradients_pointer,  # out: dS' of each chunk [chunks, heads, key_size, value_size] (the kept dtype)
    new_value_gradients_pointer,  # in: Pᵀ dO, out: du [tokens, heads, value_size] (the kept dtype)
    initial_gradient_pointer,  # out: [documents, heads, key_size, value_size] fp32
    heads,
    key_heads,
    key_size,
    value_size,
    HAS_FINAL_GRADIENT: tl.constexpr,
    GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    document, head, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offset = block * BLOCK_V
    begin, end, first_chunk, last_chunk = _document_chunks(cu_seqlens_pointer, chunk_offsets_pointer, document)
    gradient = _load_state(
        final_gradient_pointer, document, heads, head, key_size, value_size, BLOCK_K, BLOCK_V, offset,
        HAS_FINAL_GRADIENT,
    )  # fmt: skip
    kept: tl.constexpr = state_gradients_pointer.dtype.element_ty
    for step in range(0, last_chunk - first_chunk):
        chunk = last_chunk - 1 - step
        _store_state(
            state_gradients_pointer, gradient, chunk, heads, head, key_size, value_size, BLOCK_K, BLOCK_V, offset
        )
        tokens, valid, k, w, b, b_last, to_end = _read_chunk(
            k_pointer, w_pointer, log_decay_pointer, begin, end, chunk - first_chunk, heads, key_heads, head,
            key_size, GROUP, CHUNK, BLOCK_K,
        )  # fmt: skip
        q = _load_rows(q_pointer, tokens, valid, key_heads, head // GROUP, key_size, BLOCK_K, 0)
        output_gradient = _load_rows(output_gradient_pointer, tokens, valid, heads, head, value_size, BLOCK_V, offset)
        within = _load_rows(new_value_gradients_pointer, tokens, valid, heads, head, value_size, BLOCK_V, offset)
        new_value_gradient = within + _dot(k * to_end[:, None], gradient, kept)
        _store_rows(
            new_value_gradients_pointer, new_value_gradient, tokens, valid, heads, head, value_size, BLOCK_V, offset
        )
        gradient = (
            _dot(tl.trans(q * tl.exp(b)[:, None]), output_gradient, kept)
            + tl.exp(b_last) * gradient
            - _dot(tl.trans(w), new_value_gradient, kept)
        )
    _store_state(
        initial_gradient_pointer, gradient, document, heads, head, key_size, value_size, BLOCK_K, BLOCK_V, offset
    )


@triton.jit
def _key_block_part(pointer, key_block, total_tokens, heads):
    """Key block `key_block`'s [tokens, heads] part of the decays' gradient in a [key_blocks, tokens, heads] tensor."""
    return pointer + tl.cast(key_block, tl.int64) * total_tokens * heads


@triton.jit
def chunk_key_gradients(
    q_pointer,
    k_pointer,
    log_decay_pointer,
    states_pointer,
    new_values_pointer,
    output_gradient_pointer,
    state_gradients_pointer,
    new_value_gradients_pointer,
    chunk_start_pointer,
    chunk_end_pointer,
    q_gradient_pointer,  # out: [tokens, heads, key_size] per value head (fp32; q's dtype with one value head per key)
    k_gradient_pointer,  # out: [tokens, heads, key_size] fp32 (per value head; `chunk_wy_gradients` adds its part)
    w_gradient_pointer,  # out: dW [tokens, heads, key_size] (the kept dtype)
    b_gradient_pointer,  # out: each key block's part of db [key_blocks, tokens, heads] fp32
    total_tokens,
    heads,
    key_heads,
    key_size,
    value_size,
    GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    chunk, head, key_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    key_offset = key_block * BLOCK_K
    tokens, valid, count = _chunk_rows(chunk_start_pointer, chunk_end_pointer, chunk, CHUNK)
    rows = tl.arange(0, CHUNK)
    b, b_last = _load_log_decays(log_decay_pointer, tokens, valid, count, heads, head, CHUNK)
    decay = tl.where(valid, tl.exp(b), 0.0)
    to_end = tl.where(valid, tl.exp(b_last - b), 0.0)

    # The sums over the value channels, a block at a time.
    q_state_gradient = tl.zeros([CHUNK, BLOCK_K], dtype=tl.float32)  # dO Sᵀ
    k_state_gradient = tl.zeros([CHUNK, BLOCK_K], dtype=tl.float32)  # u dS'ᵀ
    w_gradient = tl.zeros([CHUNK, BLOCK_K], dtype=tl.float32)  # −du Sᵀ
    scores_gradient = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)  # dP = dO uᵀ
    state_product = tl.sum(tl.zeros([CHUNK], dtype=tl.float32), 0)  # Σ S ⊙ dS'
    kept: tl.constexpr = states_pointer.dtype.element_ty
    for offset in range(0, value_size, BLOCK_V):
        # The slots past the last chunk (`chunk_layout`) have no state written: read zeros there.
        pointers, mask = _state_pointers(
            states_pointer, chunk, heads, head, key_size, value_size, BLOCK_K, BLOCK_V, offset, key_offset
        )
        state = tl.load(pointers, mask=mask & (count > 0), other=0.0)
        pointers, mask = _state_pointers(
            state_gradients_pointer, chunk, heads, head, key_size, value_size, BLOCK_K, BLOCK_V, offset, key_offset
        )
        state_gradient = tl.load(pointers, mask=mask & (count > 0), other=0.0)
        u = _load_tile(new_values_pointer, tokens, valid, heads, head, value_size, BLOCK_V, offset)
        du = _load_tile(new_value_gradients_pointer, tokens, valid, heads, head, value_size, BLOCK_V, offset)
        do = _load_tile(output_gradient_pointer, tokens, valid, heads, head, value_size, BLOCK_V, offset)
        q_state_gradient += _dot(do, tl.trans(state), kept)
        scores_gradient += _dot(do, tl.trans(u), kept)
        k_state_gradient += _dot(u, tl.trans(state_gradient), kept)
        w_gradient -= _dot(du, tl.trans(state), kept)
        state_product += tl.sum(tl.sum(state.to(tl.float32) * state_gradient.to(tl.float32), 1), 0)

    q = _load_rows(q_pointer, tokens, valid, key_heads, head // GROUP, key_size, BLOCK_K, key_offset)
    k = _load_rows(k_pointer, tokens, valid, key_heads, head // GROUP, key_size, BLOCK_K, key_offset)
    # O = (e^b Q) S + P u, P = (Q Kᵀ) ⊙ Γ. Every term of db is a sum over key channels: this block's part.
    q_gradient = q_state_gradient * decay[:, None]
    b_gradient = tl.sum(q_gradient * q, 1)
    scores_gradient = scores_gradient * _decay_ratio(b, False, CHUNK)
    q_gradient += _dot(scores_gradient, k, kept)
    k_gradient = _dot(tl.trans(scores_gradient), q, kept)
    through_ratio = scores_gradient * _dot(q, tl.trans(k), q_pointer.dtype.element_ty)
    b_gradient += tl.sum(through_ratio, 1) - tl.sum(through_ratio, 0)
    # S' = e^{b_C} S + (K ⊙ e^{b_C − b})ᵀ u.
    k_state_gradient = k_state_gradient * to_end[:, None]
    k_gradient += k_state_gradient
    to_end_gradient = tl.sum(k_state_gradient * k, 1)
    b_gradient -= to_end_gradient
    last_gradient = tl.exp(b_last) * state_product + tl.sum(to_end_gradient, 0)
    b_gradient += tl.where(rows == count - 1, last_gradient, 0.0)

    _store_rows(q_gradient_pointer, q_gradient, tokens, valid, heads, head, key_size, BLOCK_K, key_offset)
    _store_rows(k_gradient_pointer, k_gradient, tokens, valid, heads, head, key_size, BLOCK_K, key_offset)
    _store_rows(w_gradient_pointer, w_gradient, tokens, valid, heads, head, key_size, BLOCK_K, key_offset)
    block_part = _key_block_part(b_gradient_pointer, key_block, total_tokens, heads)
    _store_head_values(block_part, b_gradient, tokens, valid, heads, head)


@triton.jit
def chunk_wy_gradients(
    k_pointer,
    v_pointer,
    beta_pointer,
    log_decay_pointer,
    inverse_pointer,
    new_value_gradients_pointer,
    w_gradient_pointer,
    b_gradient_pointer,  # in: the key blocks' parts of db
    chunk_start_pointer,
    chunk_end_pointer,
    k_gradient_pointer,  # in: `chunk_key_gradients`' part [tokens, heads, key_size] fp32 (per value head)
    k_gradient_out_pointer,  # out: k's gradient per value head (k's dtype with one value head per key head, or fp32)
    v_gradient_pointer,  # out: [tokens, heads, value_size] (v's dtype)
    beta_gradient_pointer,  # out: [tokens, heads] fp32
    g_gradient_pointer,  # out: [tokens, heads] fp32
    total_tokens,
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
    tokens, valid, count = _chunk_rows(chunk_start_pointer, chunk_end_pointer, chunk, CHUNK)
    rows = tl.arange(0, CHUNK)
    beta = _load_head_values(beta_pointer, tokens, valid, heads, head)
    b, _ = _load_log_decays(log_decay_pointer, tokens, valid, count, heads, head, CHUNK)
    inverse = tl.load(_inverse_pointers(inverse_pointer, chunk, heads, head, CHUNK))
    decay = tl.where(valid, tl.exp(b), 0.0)
    kept: tl.constexpr = new_value_gradients_pointer.dtype.element_ty
    exact: tl.constexpr = k_pointer.dtype.element_ty  # k's products with itself

    # U = T (βV): dT = dU (βV)ᵀ and d(βV) = Tᵀ dU, a block of value channels at a time.
    inverse_gradient = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)  # dT
    beta_gradient = tl.zeros([CHUNK], dtype=tl.float32)
    for offset in range(0, value_size, BLOCK_V):
        du = _load_tile(new_value_gradients_pointer, tokens, valid, heads, head, value_size, BLOCK_V, offset)
        v = _load_rows(v_pointer, tokens, valid, heads, head, value_size, BLOCK_V, offset)
        inverse_gradient += _dot(du, tl.trans(v * beta[:, None]), kept)
        weighted_v_gradient = _dot(tl.trans(inverse), du, kept)
        v_gradient = (weighted_v_gradient * beta[:, None]).to(v_gradient_pointer.dtype.element_ty)
        _store_rows(v_gradient_pointer, v_gradient, tokens, valid, heads, head, value_size, BLOCK_V, offset)
        beta_gradient += tl.sum(weighted_v_gradient * v, 1)

    # W = T (β e^b K): dT += dW (β e^b K)ᵀ; A = β (K Kᵀ) ⊙ Γ. Sums over the key channels, a block at a time.
    scale = beta * decay
    key_products = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    for key_offset in range(0, key_size, BLOCK_K):
        k = _load_rows(k_pointer, tokens, valid, key_heads, head // GROUP, key_size, BLOCK_K, key_offset)
        w_gradient = _load_tile(w_gradient_pointer, tokens, valid, heads, head, key_size, BLOCK_K, key_offset)
        inverse_gradient += _dot(w_gradient, tl.trans(k * scale[:, None]), kept)
        key_products += _dot(k, tl.trans(k), exact)
    # T = (I + A)⁻¹, A strictly below the diagonal.
    strict = _decay_ratio(b, True, CHUNK)
    lower_gradient = -_dot(_dot(tl.trans(inverse), inverse_gradient, kept), tl.trans(inverse), kept)
    lower_gradient = tl.where(rows[:, None] > rows[None, :], lower_gradient, 0.0)
    beta_gradient += tl.sum(lower_gradient * key_products * strict, 1)
    products_gradient = lower_gradient * beta[:, None] * strict
    through_lower = products_gradient * key_products
    b_gradient = tl.sum(through_lower, 1) - tl.sum(through_lower, 0)
    # k's gradient through W and A, a block of key channels at a time, added to `chunk_key_gradients`' part; that
    # kernel's parts of db.
    through_weights = tl.zeros([CHUNK], dtype=tl.float32)
    for key_offset in range(0, key_size, BLOCK_K):
        block_part = _key_block_part(b_gradient_pointer, key_offset // BLOCK_K, total_tokens, heads)
        b_gradient += _load_head_values(block_part, tokens, valid, heads, head)
        k = _load_rows(k_pointer, tokens, valid, key_heads, head // GROUP, key_size, BLOCK_K, key_offset)
        w_gradient = _load_tile(w_gradient_pointer, tokens, valid, heads, head, key_size, BLOCK_K, key_offset)
        weighted_k_gradient = _dot(tl.trans(inverse), w_gradient, kept)
        through_weights += tl.sum(weighted_k_gradient * k, 1)
        k_gradient = weighted_k_gradient * scale[:, None]
        k_gradient += _dot(products_gradient, k, kept) + _dot(tl.trans(products_gradient), k, kept)
        k_gradient += _load_rows(k_gradient_pointer, tokens, valid, heads, head, key_size, BLOCK_K, key_offset)
        _store_rows(k_gradient_out_pointer, k_gradient, tokens, valid, heads, head, key_size, BLOCK_K, key_offset)
    through_weights *= decay
    beta_gradient += through_weights
    b_gradient += beta * through_weights
    # b = cumsum(g): dg_s = Σ_{t >= s} db_t.
    g_gradient = tl.sum(tl.where(rows[:, None] <= rows[None, :], b_gradient[None, :], 0.0), 1)

    _store_head_values(beta_gradient_pointer, beta_gradient, tokens, valid, heads, head)
    _store_head_values(g_gradient_pointer, g_gradient, tokens, valid, heads, head)
