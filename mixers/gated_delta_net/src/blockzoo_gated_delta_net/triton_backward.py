"""The chunked gated delta rule's backward pass as Triton kernels (the forward's notation, `triton_forward`).

Per chunk, with S its starting state, S' the next, u = U − W S, O = (e^b Q) S + P u with P = (Q Kᵀ) ⊙ Γ and
S' = e^{b_C} S + (K ⊙ e^{b_C − b})ᵀ u, the gradients dO and dS' give:

- `chunk_new_value_gradients` (one program per chunk and value head, all chunks at once): the part of du that
  needs no later chunk, Pᵀ dO.
- `pass_state_gradients` (one program per document, value head and block of value channels; sequential, last chunk
  first, from the gradient of the final state): du = Pᵀ dO + (K ⊙ e^{b_C − b}) dS' and
  dS = (e^b Q)ᵀ dO + e^{b_C} dS' − Wᵀ du; it keeps each chunk's dS' and du, and writes the initial state's gradient.
- `chunk_gradients` (one program per chunk and value head, all chunks at once): with dP = dO uᵀ, dW = −du Sᵀ,
  dU = du, dT = dU (βV)ᵀ + dW (β e^b K)ᵀ and dA = −Tᵀ dT Tᵀ (below the diagonal), the gradients of q, k (per value
  head; the caller sums a key head's group), v, β and of b (the decays appear as e^{b_t − b_s}: +row sums −column
  sums), then dg = the reverse cumulative sum of db within the chunk.
"""

import triton
import triton.language as tl

from blockzoo_gated_delta_net.triton_forward import (
    _chunk_rows,
    _chunk_scores,
    _decay_ratio,
    _document_chunks,
    _inverse_pointers,
    _load_head_values,
    _load_log_decays,
    _load_rows,
    _load_state,
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
    new_value_gradients_pointer,  # out: Pᵀ dO [tokens, heads, value_size] fp32, completed by the state pass
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
        output_gradient = _load_rows(output_gradient_pointer, tokens, valid, heads, head, value_size, BLOCK_V, offset)
        within = tl.dot(tl.trans(scores), output_gradient)
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
    state_gradients_pointer,  # out: dS' of each chunk [chunks, heads, key_size, value_size] fp32
    new_value_gradients_pointer,  # in: Pᵀ dO, out: du [tokens, heads, value_size] fp32
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
        new_value_gradient = within + tl.dot(k * to_end[:, None], gradient)
        _store_rows(
            new_value_gradients_pointer, new_value_gradient, tokens, valid, heads, head, value_size, BLOCK_V, offset
        )
        gradient = (
            tl.dot(tl.trans(q * tl.exp(b)[:, None]), output_gradient)
            + tl.exp(b_last) * gradient
            - tl.dot(tl.trans(w), new_value_gradient)
        )
    _store_state(
        initial_gradient_pointer, gradient, document, heads, head, key_size, value_size, BLOCK_K, BLOCK_V, offset
    )


@triton.jit
def chunk_gradients(
    q_pointer,
    k_pointer,
    v_pointer,
    beta_pointer,
    log_decay_pointer,
    inverse_pointer,
    states_pointer,
    new_values_pointer,
    output_gradient_pointer,
    state_gradients_pointer,
    new_value_gradients_pointer,
    chunk_start_pointer,
    chunk_end_pointer,
    q_gradient_pointer,  # out: [tokens, heads, key_size] fp32 (per value head)
    k_gradient_pointer,  # out: [tokens, heads, key_size] fp32 (per value head)
    v_gradient_pointer,  # out: [tokens, heads, value_size] (v's dtype)
    beta_gradient_pointer,  # out: [tokens, heads] fp32
    g_gradient_pointer,  # out: [tokens, heads] fp32
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
    q = _load_rows(q_pointer, tokens, valid, key_heads, head // GROUP, key_size, BLOCK_K, 0)
    k = _load_rows(k_pointer, tokens, valid, key_heads, head // GROUP, key_size, BLOCK_K, 0)
    beta = _load_head_values(beta_pointer, tokens, valid, heads, head)
    b, b_last = _load_log_decays(log_decay_pointer, tokens, valid, count, heads, head, CHUNK)
    inverse = tl.load(_inverse_pointers(inverse_pointer, chunk, heads, head, CHUNK))
    decay = tl.where(valid, tl.exp(b), 0.0)
    to_end = tl.where(valid, tl.exp(b_last - b), 0.0)

    # The sums over the value channels, a block at a time.
    q_state_gradient = tl.zeros([CHUNK, BLOCK_K], dtype=tl.float32)  # dO Sᵀ
    k_state_gradient = tl.zeros([CHUNK, BLOCK_K], dtype=tl.float32)  # u dS'ᵀ
    w_gradient = tl.zeros([CHUNK, BLOCK_K], dtype=tl.float32)
    scores_gradient = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)  # dP
    inverse_gradient = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)  # dT
    beta_gradient = tl.zeros([CHUNK], dtype=tl.float32)
    state_product = tl.sum(tl.zeros([CHUNK], dtype=tl.float32), 0)  # Σ S ⊙ dS'
    for offset in range(0, value_size, BLOCK_V):
        pointers, mask = _state_pointers(
            states_pointer, chunk, heads, head, key_size, value_size, BLOCK_K, BLOCK_V, offset
        )
        # The slots past the last chunk (`chunk_layout`) have no state written: read zeros there.
        state = tl.load(pointers, mask=mask & (count > 0), other=0.0)
        pointers, mask = _state_pointers(
            state_gradients_pointer, chunk, heads, head, key_size, value_size, BLOCK_K, BLOCK_V, offset
        )
        state_gradient = tl.load(pointers, mask=mask & (count > 0), other=0.0)
        u = _load_rows(new_values_pointer, tokens, valid, heads, head, value_size, BLOCK_V, offset)
        du = _load_rows(new_value_gradients_pointer, tokens, valid, heads, head, value_size, BLOCK_V, offset)
        do = _load_rows(output_gradient_pointer, tokens, valid, heads, head, value_size, BLOCK_V, offset)
        v = _load_rows(v_pointer, tokens, valid, heads, head, value_size, BLOCK_V, offset)
        q_state_gradient += tl.dot(do, tl.trans(state))
        scores_gradient += tl.dot(do, tl.trans(u))
        k_state_gradient += tl.dot(u, tl.trans(state_gradient))
        w_gradient -= tl.dot(du, tl.trans(state))
        state_product += tl.sum(tl.sum(state * state_gradient, 1), 0)
        inverse_gradient += tl.dot(du, tl.trans(v * beta[:, None]))
        weighted_v_gradient = tl.dot(tl.trans(inverse), du)  # d(βV) = Tᵀ dU
        _store_rows(
            v_gradient_pointer,
            (weighted_v_gradient * beta[:, None]).to(v_gradient_pointer.dtype.element_ty),
            tokens,
            valid,
            heads,
            head,
            value_size,
            BLOCK_V,
            offset,
        )
        beta_gradient += tl.sum(weighted_v_gradient * v, 1)

    # O = (e^b Q) S + P u, P = (Q Kᵀ) ⊙ Γ.
    q_gradient = q_state_gradient * decay[:, None]
    b_gradient = tl.sum(q_gradient * q, 1)
    ratio = _decay_ratio(b, False, CHUNK)
    scores_gradient = scores_gradient * ratio
    q_gradient += tl.dot(scores_gradient, k)
    k_gradient = tl.dot(tl.trans(scores_gradient), q)
    through_ratio = scores_gradient * tl.dot(q, tl.trans(k))
    b_gradient += tl.sum(through_ratio, 1) - tl.sum(through_ratio, 0)
    # S' = e^{b_C} S + (K ⊙ e^{b_C − b})ᵀ u.
    k_state_gradient = k_state_gradient * to_end[:, None]
    k_gradient += k_state_gradient
    to_end_gradient = tl.sum(k_state_gradient * k, 1)
    b_gradient -= to_end_gradient
    last_gradient = tl.exp(b_last) * state_product + tl.sum(to_end_gradient, 0)
    b_gradient += tl.where(rows == count - 1, last_gradient, 0.0)
    # W = T (β e^b K).
    inverse_gradient += tl.dot(w_gradient, tl.trans(k * (beta * decay)[:, None]))
    weighted_k_gradient = tl.dot(tl.trans(inverse), w_gradient)
    k_gradient += weighted_k_gradient * (beta * decay)[:, None]
    through_weights = tl.sum(weighted_k_gradient * k, 1) * decay
    beta_gradient += through_weights
    b_gradient += beta * through_weights
    # T = (I + A)⁻¹, A = β (K Kᵀ) ⊙ Γ strictly below the diagonal.
    strict = _decay_ratio(b, True, CHUNK)
    lower_gradient = -tl.dot(tl.dot(tl.trans(inverse), inverse_gradient), tl.trans(inverse))
    lower_gradient = tl.where(rows[:, None] > rows[None, :], lower_gradient, 0.0)
    key_products = tl.dot(k, tl.trans(k))
    beta_gradient += tl.sum(lower_gradient * key_products * strict, 1)
    products_gradient = lower_gradient * beta[:, None] * strict
    k_gradient += tl.dot(products_gradient, k) + tl.dot(tl.trans(products_gradient), k)
    through_lower = products_gradient * key_products
    b_gradient += tl.sum(through_lower, 1) - tl.sum(through_lower, 0)
    # b = cumsum(g): dg_s = Σ_{t >= s} db_t.
    g_gradient = tl.sum(tl.where(rows[:, None] <= rows[None, :], b_gradient[None, :], 0.0), 1)

    _store_rows(q_gradient_pointer, q_gradient, tokens, valid, heads, head, key_size, BLOCK_K, 0)
    _store_rows(k_gradient_pointer, k_gradient, tokens, valid, heads, head, key_size, BLOCK_K, 0)
    _store_head_values(beta_gradient_pointer, beta_gradient, tokens, valid, heads, head)
    _store_head_values(g_gradient_pointer, g_gradient, tokens, valid, heads, head)
