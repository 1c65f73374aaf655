"""Mamba 1's selective scan as Triton kernels: `forward_kernel` and `backward_kernel`, one program per (document or
lane of documents, block of channels). What they compute and how they are launched: `triton_selective_scan`.
Imports triton: import it only where Triton runs."""

import triton
import triton.language as tl


@triton.jit
def _load_row(pointer, token, row_size, offsets, mask):
    """Elements `offsets` of row `token` of a row-major [tokens, row_size] tensor, in fp32 (0 where masked)."""
    return tl.load(pointer + tl.cast(token, tl.int64) * row_size + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _channel_block(
    block, channels, groups, state_size, channels_per_group, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Block `block` of channels: (channel, channel_mask, n, n_mask, bc_offsets, bc_row, state_offsets, state_mask),
    the channels and state entries with their masks, the offsets of the block's group in a row of B or C and that
    row's size, and the offsets and mask of the block's [BLOCK_D, BLOCK_N] tile of a [channels, state] tensor."""
    channel = block * BLOCK_D + tl.arange(0, BLOCK_D)
    channel_mask = channel < channels  # always true (BLOCK_D divides channels); a tensor to combine masks with
    n = tl.arange(0, BLOCK_N)
    n_mask = n < state_size
    bc_offsets = (block * BLOCK_D // channels_per_group) * state_size + n
    bc_row = groups * state_size
    state_offsets = channel[:, None] * state_size + n[None, :]
    state_mask = channel_mask[:, None] & n_mask[None, :]
    return channel, channel_mask, n, n_mask, bc_offsets, bc_row, state_offsets, state_mask


@triton.jit
def forward_kernel(
    u_pointer,
    delta_pointer,
    a_pointer,
    b_pointer,
    c_pointer,
    y_pointer,
    cu_seqlens_pointer,
    checkpoint_pointer,
    checkpoint_base_pointer,
    initial_pointer,
    final_pointer,
    channels,
    groups,
    state_size,
    channels_per_group,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERVAL: tl.constexpr,
    STORE_CHECKPOINTS: tl.constexpr,
    HAS_INITIAL: tl.constexpr,
    STORE_FINAL: tl.constexpr,
):
    document = tl.program_id(0)
    block = tl.program_id(1)
    start = tl.load(cu_seqlens_pointer + document)
    end = tl.load(cu_seqlens_pointer + document + 1)
    channel, channel_mask, _, n_mask, bc_offsets, bc_row, state_offsets, state_mask = _channel_block(
        block, channels, groups, state_size, channels_per_group, BLOCK_D, BLOCK_N
    )
    a = tl.load(a_pointer + state_offsets, mask=state_mask, other=0.0)
    checkpoint = checkpoint_pointer + tl.load(checkpoint_base_pointer + document).to(tl.int64) * channels * state_size
    document_state = tl.cast(document, tl.int64) * channels * state_size  # this document's [channels, state] row
    if HAS_INITIAL:
        state = tl.load(initial_pointer + document_state + state_offsets, mask=state_mask, other=0.0)
    else:
        state = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)

    # Each step loads the next token's inputs before computing this one, so the loads' latency overlaps.
    valid = start < end
    u = _load_row(u_pointer, start, channels, channel, channel_mask & valid)
    delta = _load_row(delta_pointer, start, channels, channel, channel_mask & valid)
    b = _load_row(b_pointer, start, bc_row, bc_offsets, n_mask & valid)
    c = _load_row(c_pointer, start, bc_row, bc_offsets, n_mask & valid)
    for t in range(start, end):
        if STORE_CHECKPOINTS:
            position = t - start
            if (position > 0) & (position % INTERVAL == 0):
                row = tl.cast(position // INTERVAL - 1, tl.int64) * channels * state_size
                tl.store(checkpoint + row + state_offsets, state, mask=state_mask)
        valid = t + 1 < end
        next_u = _load_row(u_pointer, t + 1, channels, channel, channel_mask & valid)
        next_delta = _load_row(delta_pointer, t + 1, channels, channel, channel_mask & valid)
        next_b = _load_row(b_pointer, t + 1, bc_row, bc_offsets, n_mask & valid)
        next_c = _load_row(c_pointer, t + 1, bc_row, bc_offsets, n_mask & valid)

        state = tl.exp(delta[:, None] * a) * state + (delta * u)[:, None] * b[None, :]
        y = tl.sum(state * c[None, :], axis=1)
        tl.store(
            y_pointer + tl.cast(t, tl.int64) * channels + channel, y.to(y_pointer.dtype.element_ty), mask=channel_mask
        )
        u, delta, b, c = next_u, next_delta, next_b, next_c
    if STORE_FINAL:
        tl.store(final_pointer + document_state + state_offsets, state, mask=state_mask)


@triton.jit
def backward_kernel(
    u_pointer,
    delta_pointer,
    a_pointer,
    b_pointer,
    c_pointer,
    dy_pointer,
    cu_seqlens_pointer,
    checkpoint_pointer,
    checkpoint_base_pointer,
    initial_pointer,
    dfinal_pointer,
    scratch_pointer,
    du_pointer,
    ddelta_pointer,
    da_partial_pointer,
    db_partial_pointer,
    dc_partial_pointer,
    dinitial_pointer,
    tokens,
    documents,
    channels,
    groups,
    state_size,
    channels_per_group,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERVAL: tl.constexpr,
    HAS_INITIAL: tl.constexpr,
    HAS_DFINAL: tl.constexpr,
):
    # Program (lane, block) handles documents lane, lane + lanes, ... for one block of channels.
    lane = tl.program_id(0)
    block = tl.program_id(1)
    lanes = tl.num_programs(0)
    blocks = tl.num_programs(1)
    channel, channel_mask, n, n_mask, bc_offsets, bc_row, state_offsets, state_mask = _channel_block(
        block, channels, groups, state_size, channels_per_group, BLOCK_D, BLOCK_N
    )
    a = tl.load(a_pointer + state_offsets, mask=state_mask, other=0.0)
    tile = tl.arange(0, BLOCK_D)[:, None] * BLOCK_N + n[None, :]
    scratch = scratch_pointer + (lane * blocks + block).to(tl.int64) * INTERVAL * BLOCK_D * BLOCK_N + tile
    # This block's rows of the [blocks, tokens, state] partial sums of dB and dC.
    db_partial = db_partial_pointer + block.to(tl.int64) * tokens * state_size
    dc_partial = dc_partial_pointer + block.to(tl.int64) * tokens * state_size
    da = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)

    for document in range(lane, documents, lanes):
        start = tl.load(cu_seqlens_pointer + document)
        end = tl.load(cu_seqlens_pointer + document + 1)
        checkpoint = (
            checkpoint_pointer + tl.load(checkpoint_base_pointer + document).to(tl.int64) * channels * state_size
        )
        chunks = tl.cdiv(end - start, INTERVAL)
        document_state = tl.cast(document, tl.int64) * channels * state_size
        # d loss / d s_t through the later tokens, i.e. exp(delta_{t+1} A) * (d loss / d s_{t+1}); at the document's
        # end, the gradient of its final state.
        if HAS_DFINAL:
            carry = tl.load(dfinal_pointer + document_state + state_offsets, mask=state_mask, other=0.0)
        else:
            carry = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)
        for reversed_chunk in range(0, chunks):
            chunk = chunks - 1 - reversed_chunk
            chunk_start = start + chunk * INTERVAL
            chunk_end = tl.minimum(chunk_start + INTERVAL, end)
            # The state before the chunk: the initial state (or zero) for the first chunk, else its checkpoint.
            row = tl.cast(tl.maximum(chunk, 1) - 1, tl.int64) * channels * state_size
            state = tl.load(checkpoint + row + state_offsets, mask=state_mask & (chunk > 0), other=0.0)
            if HAS_INITIAL:
                state += tl.load(
                    initial_pointer + document_state + state_offsets, mask=state_mask & (chunk == 0), other=0.0
                )

            # Recompute the chunk's states: scratch row i holds the state before token chunk_start + i.
            u = _load_row(u_pointer, chunk_start, channels, channel, channel_mask)
            delta = _load_row(delta_pointer, chunk_start, channels, channel, channel_mask)
            b = _load_row(b_pointer, chunk_start, bc_row, bc_offsets, n_mask)
            for t in range(chunk_start, chunk_end):
                tl.store(scratch + (t - chunk_start) * BLOCK_D * BLOCK_N, state)
                valid = t + 1 < chunk_end
                next_u = _load_row(u_pointer, t + 1, channels, channel, channel_mask & valid)
                next_delta = _load_row(delta_pointer, t + 1, channels, channel, channel_mask & valid)
                next_b = _load_row(b_pointer, t + 1, bc_row, bc_offsets, n_mask & valid)
                state = tl.exp(delta[:, None] * a) * state + (delta * u)[:, None] * b[None, :]
                u, delta, b = next_u, next_delta, next_b
            # The scratch rows were written by other threads of this program.
            tl.debug_barrier()

            # Walk the chunk in reverse.
            last = chunk_end - 1
            previous = tl.load(scratch + (last - chunk_start) * BLOCK_D * BLOCK_N)
            u = _load_row(u_pointer, last, channels, channel, channel_mask)
            delta = _load_row(delta_pointer, last, channels, channel, channel_mask)
            b = _load_row(b_pointer, last, bc_row, bc_offsets, n_mask)
            c = _load_row(c_pointer, last, bc_row, bc_offsets, n_mask)
            dy = _load_row(dy_pointer, last, channels, channel, channel_mask)
            for reversed_t in range(0, chunk_end - chunk_start):
                t = last - reversed_t
                valid = t > chunk_start
                earlier = tl.maximum(t - 1, chunk_start)
                next_previous = tl.load(scratch + (earlier - chunk_start) * BLOCK_D * BLOCK_N)
                next_u = _load_row(u_pointer, t - 1, channels, channel, channel_mask & valid)
                next_delta = _load_row(delta_pointer, t - 1, channels, channel, channel_mask & valid)
                next_b = _load_row(b_pointer, t - 1, bc_row, bc_offsets, n_mask & valid)
                next_c = _load_row(c_pointer, t - 1, bc_row, bc_offsets, n_mask & valid)
                next_dy = _load_row(dy_pointer, t - 1, channels, channel, channel_mask & valid)

                decay = tl.exp(delta[:, None] * a)
                decayed = decay * previous  # exp(delta_t A) s_{t-1}
                state = decayed + (delta * u)[:, None] * b[None, :]  # s_t
                grad_state = dy[:, None] * c[None, :] + carry  # d loss / d s_t
                row = tl.cast(t, tl.int64)
                tl.store(dc_partial + row * state_size + n, tl.sum(dy[:, None] * state, axis=0), mask=n_mask)
                tl.store(
                    db_partial + row * state_size + n, tl.sum(grad_state * (delta * u)[:, None], axis=0), mask=n_mask
                )
                du = delta * tl.sum(grad_state * b[None, :], axis=1)
                ddelta = tl.sum(grad_state * (decayed * a + u[:, None] * b[None, :]), axis=1)
                tl.store(du_pointer + row * channels + channel, du.to(du_pointer.dtype.element_ty), mask=channel_mask)
                tl.store(
                    ddelta_pointer + row * channels + channel,
                    ddelta.to(ddelta_pointer.dtype.element_ty),
                    mask=channel_mask,
                )
                da += grad_state * decayed * delta[:, None]
                carry = decay * grad_state
                previous, u, delta, b, c, dy = next_previous, next_u, next_delta, next_b, next_c, next_dy
            # The next chunk overwrites scratch rows that other threads may still be reading.
            tl.debug_barrier()
        if HAS_INITIAL:  # what is carried past the document's first token is the initial state's gradient
            tl.store(dinitial_pointer + document_state + state_offsets, carry, mask=state_mask)

    tl.store(da_partial_pointer + lane.to(tl.int64) * channels * state_size + state_offsets, da, mask=state_mask)
