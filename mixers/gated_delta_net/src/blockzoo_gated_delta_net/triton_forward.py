"""The chunked gated delta rule's forward pass as Triton kernels (the WY / UT form of `delta_rule`'s docstring).

Three kernels, over packed documents cut into chunks of CHUNK tokens (a document's last chunk may be shorter; its
missing rows read k = v = β = 0 and g = 0, so they change nothing):

- `prepare_chunks` (`triton_prepare`; one program per chunk and value head, all chunks at once): the within-chunk
  log decays b = cumsum(g), A[t, s] = β_t (k_t·k_s) e^{b_t − b_s} below the diagonal, T = (I + A)⁻¹ and the WY
  factors W = T (β e^b K), U = T (β V).
- `pass_states` (one program per document, value head and block of value channels; the only sequential part, kept
  to the least that depends on the previous chunk): from the document's initial state S, chunk after chunk,
  u = U − W S and S ← e^{b_C} S + (K ⊙ e^{b_C − b})ᵀ u. It keeps each chunk's starting state and u.
- `chunk_outputs` (one program per chunk and value head, all chunks at once): O = (e^b Q) S + ((Q Kᵀ) ⊙ Γ) u.

Everything is accumulated in fp32 whatever the inputs' dtype (bf16 inputs are read as they are, converted in
registers). Value head h reads key head h // GROUP (grouped heads). Imports triton: import it only where Triton runs.
"""

import triton
import triton.language as tl


@triton.jit
def _chunk_rows(chunk_start_pointer, chunk_end_pointer, chunk, CHUNK: tl.constexpr):
    """The token of each row of `chunk`, and which rows lie inside its document."""
    start = tl.load(chunk_start_pointer + chunk).to(tl.int64)
    end = tl.load(chunk_end_pointer + chunk).to(tl.int64)
    tokens = start + tl.arange(0, CHUNK)
    return tokens, tokens < end, end - start


@triton.jit
def _load_tile(pointer, tokens, valid, heads, head, size, BLOCK: tl.constexpr, offset):
    """x[tokens, head, offset : offset + BLOCK] of a [tokens, heads, size] tensor in its own dtype (zeros outside):
    for tiles that only feed dots, which take them as they are."""
    columns = offset + tl.arange(0, BLOCK)
    mask = valid[:, None] & (columns < size)[None, :]
    return tl.load(pointer + (tokens * heads + head)[:, None] * size + columns[None, :], mask=mask, other=0.0)


@triton.jit
def _load_rows(pointer, tokens, valid, heads, head, size, BLOCK: tl.constexpr, offset):
    """x[tokens, head, offset : offset + BLOCK] of a [tokens, heads, size] tensor, in fp32 (zeros outside)."""
    return _load_tile(pointer, tokens, valid, heads, head, size, BLOCK, offset).to(tl.float32)


@triton.jit
def _load_head_values(pointer, tokens, valid, heads, head):
    """x[tokens, head] of a [tokens, heads] tensor, in fp32 (zeros outside)."""
    return tl.load(pointer + tokens * heads + head, mask=valid, other=0.0).to(tl.float32)


@triton.jit
def _store_head_values(pointer, value, tokens, valid, heads, head):
    """x[tokens, head] = value of a [tokens, heads] tensor, where valid."""
    tl.store(pointer + tokens * heads + head, value, mask=valid)


@triton.jit
def _store_rows(pointer, value, tokens, valid, heads, head, size, BLOCK: tl.constexpr, offset):
    columns = offset + tl.arange(0, BLOCK)
    mask = valid[:, None] & (columns < size)[None, :]
    tl.store(pointer + (tokens * heads + head)[:, None] * size + columns[None, :], value, mask=mask)


@triton.jit
def _dot(a, b, dtype: tl.constexpr):
    """a b with both operands in `dtype`, accumulated in fp32: that of the intermediates the kernels keep (fp32: TF32
    products, tl.dot's default; bf16: flash-linear-attention's choice), or the inputs' own for products of inputs
    (exact: bf16 inputs converted to fp32 convert back without loss)."""
    return tl.dot(a.to(dtype), b.to(dtype))


@triton.jit
def _decay_ratio(b, STRICT: tl.constexpr, CHUNK: tl.constexpr):
    """Γ[t, s] = e^{b_t − b_s} for s < t (STRICT) or s <= t, zero elsewhere (masked before the exp: above the
    diagonal the difference may overflow)."""
    rows = tl.arange(0, CHUNK)
    keep = rows[:, None] >= rows[None, :] + (1 if STRICT else 0)
    return tl.where(keep, tl.exp(tl.where(keep, b[:, None] - b[None, :], 0.0)), 0.0)


@triton.jit
def _last_row(x, count, CHUNK: tl.constexpr):
    """x[count − 1] of a [CHUNK] vector (the chunk's last token inside its document)."""
    return tl.sum(tl.where(tl.arange(0, CHUNK) == count - 1, x, 0.0), 0)


@triton.jit
def _load_log_decays(pointer, tokens, valid, count, heads, head, CHUNK: tl.constexpr):
    """(b, b_C) of a chunk from the stored cumulative log decays, the rows past the document's end holding b_C (no
    further decay, as `prepare_chunks` makes them): with zeros there, e^{b_t − b_s} of a padding row t would overflow
    once the chunk's decays pass e^-88, and 0 · inf poisons the products that read the row."""
    b = _load_head_values(pointer, tokens, valid, heads, head)
    b_last = _last_row(b, count, CHUNK)
    return tl.where(valid, b, b_last), b_last


@triton.jit
def _inverse_pointers(pointer, chunk, heads, head, CHUNK: tl.constexpr):
    """Pointers of T[chunk, head] in a [chunks, heads, CHUNK, CHUNK] tensor (`prepare_chunks` writes it, the
    backward reads it)."""
    rows = tl.arange(0, CHUNK)
    base = (chunk * heads + head).to(tl.int64) * CHUNK * CHUNK
    return pointer + base + rows[:, None] * CHUNK + rows[None, :]


@triton.jit
def _state_pointers(
    pointer, index, heads, head, key_size, value_size, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, offset,
    key_offset,
):  # fmt: skip
    """Pointers and mask of S[index, head, key_offset : key_offset + BLOCK_K, offset : offset + BLOCK_V] in a
    [n, heads, key_size, value_size] tensor."""
    keys = key_offset + tl.arange(0, BLOCK_K)
    values = offset + tl.arange(0, BLOCK_V)
    base = (tl.cast(index, tl.int64) * heads + head) * key_size * value_size
    mask = (keys < key_size)[:, None] & (values < value_size)[None, :]
    return pointer + base + keys[:, None] * value_size + values[None, :], mask


@triton.jit
def _load_state(
    pointer, index, heads, head, key_size, value_size, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, offset,
    LOAD: tl.constexpr,
):  # fmt: skip
    """S[index, head, :, offset : offset + BLOCK_V] in fp32, or zeros where there is none to read (not LOAD)."""
    state = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    if LOAD:
        pointers, mask = _state_pointers(pointer, index, heads, head, key_size, value_size, BLOCK_K, BLOCK_V, offset, 0)
        state = tl.load(pointers, mask=mask, other=0.0).to(tl.float32)
    return state


@triton.jit
def _store_state(
    pointer, state, index, heads, head, key_size, value_size, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, offset
):
    pointers, mask = _state_pointers(pointer, index, heads, head, key_size, value_size, BLOCK_K, BLOCK_V, offset, 0)
    tl.store(pointers, state, mask=mask)


@triton.jit
def _document_chunks(cu_seqlens_pointer, chunk_offsets_pointer, document):
    """The document's tokens [begin, end) and its chunks [first, last) (the state-passing kernels' programs)."""
    begin = tl.load(cu_seqlens_pointer + document).to(tl.int64)
    end = tl.load(cu_seqlens_pointer + document + 1).to(tl.int64)
    first = tl.load(chunk_offsets_pointer + document)
    last = tl.load(chunk_offsets_pointer + document + 1)
    return begin, end, first, last


@triton.jit
def _read_chunk(
    k_pointer, w_pointer, log_decay_pointer, begin, end, index, heads, key_heads, head, key_size,
    GROUP: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """What both state passes read of a document's chunk `index` (counted from its first): its tokens, which lie in
    the document; k, W and b; e^{b_C − b} (zero outside); b_C."""
    tokens = begin + index * CHUNK + tl.arange(0, CHUNK)
    valid = tokens < end
    count = tl.minimum(end - begin - index * CHUNK, CHUNK)
    k = _load_rows(k_pointer, tokens, valid, key_heads, head // GROUP, key_size, BLOCK_K, 0)
    w = _load_rows(w_pointer, tokens, valid, heads, head, key_size, BLOCK_K, 0)
    b, b_last = _load_log_decays(log_decay_pointer, tokens, valid, count, heads, head, CHUNK)
    to_end = tl.where(valid, tl.exp(b_last - b), 0.0)
    return tokens, valid, k, w, b, b_last, to_end


@triton.jit
def pass_states(
    k_pointer,
    w_pointer,
    u_pointer,
    log_decay_pointer,
    initial_pointer,
    cu_seqlens_pointer,
    chunk_offsets_pointer,
    final_pointer,  # out: [documents, heads, key_size, value_size] fp32
    states_pointer,  # out: each chunk's starting state [chunks, heads, key_size, value_size] (the kept dtype)
    new_values_pointer,  # out: u [tokens, heads, value_size] (the kept dtype)
    heads,
    key_heads,
    key_size,
    value_size,
    HAS_INITIAL: tl.constexpr,
    GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    document, head, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offset = block * BLOCK_V
    begin, end, first_chunk, last_chunk = _document_chunks(cu_seqlens_pointer, chunk_offsets_pointer, document)
    state = _load_state(
        initial_pointer, document, heads, head, key_size, value_size, BLOCK_K, BLOCK_V, offset, HAS_INITIAL
    )
    kept: tl.constexpr = new_values_pointer.dtype.element_ty
    for chunk in range(first_chunk, last_chunk):
        _store_state(states_pointer, state, chunk, heads, head, key_size, value_size, BLOCK_K, BLOCK_V, offset)
        tokens, valid, k, w, _, b_last, to_end = _read_chunk(
            k_pointer, w_pointer, log_decay_pointer, begin, end, chunk - first_chunk, heads, key_heads, head,
            key_size, GROUP, CHUNK, BLOCK_K,
        )  # fmt: skip
        u = _load_rows(u_pointer, tokens, valid, heads, head, value_size, BLOCK_V, offset)
        u = u - _dot(w, state, kept)
        _store_rows(new_values_pointer, u, tokens, valid, heads, head, value_size, BLOCK_V, offset)
        state = tl.exp(b_last) * state + _dot(tl.trans(k * to_end[:, None]), u, kept)
    _store_state(final_pointer, state, document, heads, head, key_size, value_size, BLOCK_K, BLOCK_V, offset)


@triton.jit
def _chunk_scores(
    q_pointer, k_pointer, log_decay_pointer, chunk_start_pointer, chunk_end_pointer, chunk, heads, key_heads, head,
    key_size, GROUP: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """A chunk's tokens, which lie in its document and how many; e^b Q; the scores P = (Q Kᵀ) ⊙ Γ."""
    tokens, valid, count = _chunk_rows(chunk_start_pointer, chunk_end_pointer, chunk, CHUNK)
    q = _load_rows(q_pointer, tokens, valid, key_heads, head // GROUP, key_size, BLOCK_K, 0)
    k = _load_rows(k_pointer, tokens, valid, key_heads, head // GROUP, key_size, BLOCK_K, 0)
    b, _ = _load_log_decays(log_decay_pointer, tokens, valid, count, heads, head, CHUNK)
    scores = _dot(q, tl.trans(k), q_pointer.dtype.element_ty) * _decay_ratio(b, False, CHUNK)
    return tokens, valid, count, q * tl.exp(b)[:, None], scores


@triton.jit
def chunk_outputs(
    q_pointer,
    k_pointer,
    log_decay_pointer,
    states_pointer,
    new_values_pointer,
    chunk_start_pointer,
    chunk_end_pointer,
    output_pointer,  # out: O [tokens, heads, value_size] (the output's dtype)
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
    tokens, valid, count, decayed_q, scores = _chunk_scores(
        q_pointer, k_pointer, log_decay_pointer, chunk_start_pointer, chunk_end_pointer, chunk, heads, key_heads,
        head, key_size, GROUP, CHUNK, BLOCK_K,
    )  # fmt: skip
    kept: tl.constexpr = new_values_pointer.dtype.element_ty
    for offset in range(0, value_size, BLOCK_V):
        pointers, mask = _state_pointers(
            states_pointer, chunk, heads, head, key_size, value_size, BLOCK_K, BLOCK_V, offset, 0
        )
        # The slots past the last chunk (`chunk_layout`) have no state written: read zeros there.
        state = tl.load(pointers, mask=mask & (count > 0), other=0.0)
        u = _load_tile(new_values_pointer, tokens, valid, heads, head, value_size, BLOCK_V, offset)
        output = _dot(decayed_q, state, kept) + _dot(scores, u, kept)
        _store_rows(
            output_pointer, output.to(output_pointer.dtype.element_ty), tokens, valid, heads, head, value_size,
            BLOCK_V, offset,
        )  # fmt: skip
