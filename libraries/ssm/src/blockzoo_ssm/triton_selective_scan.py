"""Mamba 1's selective scan as Triton kernels, forward and backward, over packed documents.

Per document (the state starts at zero, or at the document's given initial state), for every channel d and state
index n:

    s_t = exp(delta_t[d] * A[d, n]) * s_{t-1} + delta_t[d] * u_t[d] * B_t[g(d), n]
    y_t[d] = sum_n s_t[d, n] * C_t[g(d), n]                    g(d) = d // (channels // groups)

One program per (document, block of channels) keeps the state [BLOCK_D, state] in registers and walks the
document's tokens in order, in fp32. The forward also stores the state every CHECKPOINT_INTERVAL tokens, and each
document's final state. The backward walks each document's chunks from last to first, starting from the final
state's gradient: it recomputes the chunk's states from its checkpoint (the initial state for the first chunk)
into a per-program scratch buffer, then walks the chunk in reverse; what it carries past the document's first
token is the initial state's gradient. Memory: checkpoints tokens / interval states,
scratch interval states per backward program, never one state per token.

Gradients shared between programs are written as partial sums and added by torch, not with atomics: dA per
(program lane, channel), dB and dC per (channel block, token). A channel block never spans two groups: its size
divides channels // groups.

Used by `blockzoo_ssm.selective_scan` on CUDA; imports triton, so import it only there (or under
TRITON_INTERPRET=1 with CPU tensors, as the tests do).
"""

import contextlib

import torch
import triton
import triton.language as tl

# Tokens between stored states: the forward keeps tokens / interval states for the backward, and each backward
# program recomputes at most this many states into its scratch buffer.
CHECKPOINT_INTERVAL = 32
# State elements per program and per thread: BLOCK_D * BLOCK_N = _TILE_ELEMENTS where the channels allow,
# num_warps = _TILE_ELEMENTS / (32 * _ELEMENTS_PER_THREAD).
_TILE_ELEMENTS = 512
_ELEMENTS_PER_THREAD = 4
# Backward programs resident per multiprocessor (each holds a scratch buffer of CHECKPOINT_INTERVAL states).
_BACKWARD_PROGRAMS_PER_SM = 8


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
def _forward_kernel(
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
def _backward_kernel(
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


def _block_sizes(documents: int, channels: int, channels_per_group: int, state_size: int, device: torch.device):
    """(BLOCK_D, BLOCK_N, num_warps). BLOCK_D: a power of two dividing channels_per_group, as large as a tile of
    _TILE_ELEMENTS allows, smaller while that leaves fewer than two programs per multiprocessor (few documents)."""
    block_n = triton.next_power_of_2(state_size)
    block_d = 1
    while block_d * 2 * block_n <= _TILE_ELEMENTS and channels_per_group % (block_d * 2) == 0:
        block_d *= 2
    if device.type == "cuda":
        multiprocessors = torch.cuda.get_device_properties(device).multi_processor_count
        # Not below 8: the dB and dC partial sums take tokens * channels * state / BLOCK_D floats each.
        while block_d > 8 and documents * (channels // block_d) < 2 * multiprocessors:
            block_d //= 2
    num_warps = min(8, max(1, block_d * block_n // (32 * _ELEMENTS_PER_THREAD)))
    return block_d, block_n, num_warps


def _backward_lanes(documents: int, blocks: int, device: torch.device) -> int:
    """Programs per channel block in the backward, each walking every lanes-th document."""
    if device.type == "cuda":
        resident = _BACKWARD_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    else:  # The interpreter runs programs one by one; few lanes exercise the walk over several documents.
        resident = 2
    return max(1, min(documents, resident // blocks))


def _checkpoint_bases(cu_seqlens: torch.Tensor, interval: int) -> torch.Tensor:
    """Each document's first checkpoint row: a document of length L stores (L - 1) // interval states."""
    counts = (cu_seqlens[1:] - cu_seqlens[:-1] - 1).clamp(min=0) // interval
    return (torch.cumsum(counts, 0) - counts).to(torch.int32)


def _on_device(tensor: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensor's (the interpreter needs nothing)."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


class _SelectiveScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, delta, A, B, C, cu_seqlens, initial_states):
        tokens, channels = u.shape
        groups, state_size = B.shape[1], B.shape[2]
        documents = cu_seqlens.numel() - 1
        channels_per_group = channels // groups
        block_d, block_n, num_warps = _block_sizes(documents, channels, channels_per_group, state_size, u.device)
        store_checkpoints = any(ctx.needs_input_grad[:5]) or ctx.needs_input_grad[6]
        interval = CHECKPOINT_INTERVAL
        bases = _checkpoint_bases(cu_seqlens, interval)
        # At least one row (a valid pointer); at most tokens // interval rows are used, whatever the lengths.
        checkpoint_rows = tokens // interval + 1 if store_checkpoints else 1
        checkpoints = u.new_empty((checkpoint_rows, channels, state_size), dtype=torch.float32)
        y = torch.empty_like(u)
        finals = u.new_empty((documents, channels, state_size), dtype=torch.float32)
        if documents > 0:
            with _on_device(u):
                _forward_kernel[(documents, channels // block_d)](
                    u,
                    delta,
                    A,
                    B,
                    C,
                    y,
                    cu_seqlens,
                    checkpoints,
                    bases,
                    checkpoints if initial_states is None else initial_states,  # any valid pointer when unused
                    finals,
                    channels,
                    groups,
                    state_size,
                    channels_per_group,
                    BLOCK_D=block_d,
                    BLOCK_N=block_n,
                    INTERVAL=interval,
                    STORE_CHECKPOINTS=store_checkpoints,
                    HAS_INITIAL=initial_states is not None,
                    STORE_FINAL=True,
                    num_warps=num_warps,
                )
        ctx.save_for_backward(u, delta, A, B, C, cu_seqlens, checkpoints, bases, initial_states)
        ctx.sizes = (block_d, block_n, num_warps, interval)
        ctx.set_materialize_grads(False)
        return y, finals

    @staticmethod
    def backward(ctx, dy, dfinals):
        u, delta, A, B, C, cu_seqlens, checkpoints, bases, initial_states = ctx.saved_tensors
        block_d, block_n, num_warps, interval = ctx.sizes
        tokens, channels = u.shape
        groups, state_size = B.shape[1], B.shape[2]
        documents = cu_seqlens.numel() - 1
        blocks = channels // block_d
        lanes = _backward_lanes(documents, blocks, u.device)
        dy = torch.zeros_like(u) if dy is None else dy.contiguous()
        du = torch.empty_like(u)
        ddelta = torch.empty_like(delta)
        da_partial = torch.empty((lanes, channels, state_size), dtype=torch.float32, device=u.device)
        db_partial = torch.empty((blocks, tokens, state_size), dtype=torch.float32, device=u.device)
        dc_partial = torch.empty_like(db_partial)
        dinitials = None if initial_states is None else torch.empty_like(initial_states)
        scratch = torch.empty(lanes * blocks * interval * block_d * block_n, dtype=torch.float32, device=u.device)
        if documents > 0:
            with _on_device(u):
                _backward_kernel[(lanes, blocks)](
                    u,
                    delta,
                    A,
                    B,
                    C,
                    dy,
                    cu_seqlens,
                    checkpoints,
                    bases,
                    checkpoints if initial_states is None else initial_states,  # any valid pointer when unused
                    checkpoints if dfinals is None else dfinals.float().contiguous(),
                    scratch,
                    du,
                    ddelta,
                    da_partial,
                    db_partial,
                    dc_partial,
                    checkpoints if dinitials is None else dinitials,
                    tokens,
                    documents,
                    channels,
                    groups,
                    state_size,
                    channels // groups,
                    BLOCK_D=block_d,
                    BLOCK_N=block_n,
                    INTERVAL=interval,
                    HAS_INITIAL=initial_states is not None,
                    HAS_DFINAL=dfinals is not None,
                    num_warps=num_warps,
                )

        def per_group(partial):  # [blocks, tokens, state] -> [tokens, groups, state]: sum the blocks of a group
            return partial.view(groups, blocks // groups, tokens, state_size).sum(1).transpose(0, 1)

        dA = da_partial.sum(0).to(A.dtype)
        dB = per_group(db_partial).to(B.dtype)
        dC = per_group(dc_partial).to(C.dtype)
        return du, ddelta, dA, dB, dC, None, dinitials


def selective_scan_triton(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Mamba 1's selective scan over packed documents; differentiable in u, delta, A, B, C and the initial states.

    u, delta [tokens, channels] (delta positive); A [channels, state] (used in fp32); B, C [tokens, groups, state]
    with channels % groups == 0; cu_seqlens [documents + 1] document boundaries with cu_seqlens[-1] == tokens (not
    checked here: that would wait for the device). `initial_states` [documents, channels, state] (fp32): the state
    each document starts from (None: zeros). Returns y [tokens, channels] in u's dtype, accumulated in fp32, and
    with `return_final_states` the state after each document's last token [documents, channels, state] (fp32,
    differentiable); each gradient has its input's dtype.
    """
    _check_inputs(u, delta, A, B, C, cu_seqlens)
    documents, channels, state_size = cu_seqlens.numel() - 1, u.shape[1], B.shape[2]
    if initial_states is not None and tuple(initial_states.shape) != (documents, channels, state_size):
        raise ValueError(
            f"selective_scan_triton: initial_states must be [documents, channels, state] = "
            f"{(documents, channels, state_size)}, got {tuple(initial_states.shape)}"
        )
    if initial_states is not None:
        initial_states = initial_states.float().contiguous()
    u, delta, B, C = (tensor.contiguous() for tensor in (u, delta, B, C))
    y, finals = _SelectiveScan.apply(
        u, delta, A.float().contiguous(), B, C, cu_seqlens.to(torch.int32).contiguous(), initial_states
    )
    return (y, finals) if return_final_states else y


def _check_inputs(u, delta, A, B, C, cu_seqlens) -> None:
    if u.dim() != 2:
        raise ValueError(f"selective_scan_triton: u must be [tokens, channels], got shape {tuple(u.shape)}")
    tokens, channels = u.shape
    if delta.shape != u.shape:
        raise ValueError(f"selective_scan_triton: delta has shape {tuple(delta.shape)}, u {tuple(u.shape)}")
    if B.dim() != 3 or B.shape[0] != tokens:
        raise ValueError(f"selective_scan_triton: B must be [tokens={tokens}, groups, state], got {tuple(B.shape)}")
    if C.shape != B.shape:
        raise ValueError(f"selective_scan_triton: C has shape {tuple(C.shape)}, B {tuple(B.shape)}")
    groups, state_size = B.shape[1], B.shape[2]
    if groups == 0 or channels % groups != 0:
        raise ValueError(f"selective_scan_triton: channels ({channels}) must be a multiple of groups ({groups})")
    if A.shape != (channels, state_size):
        raise ValueError(f"selective_scan_triton: A must be [{channels}, {state_size}], got {tuple(A.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() == 0 or cu_seqlens.dtype.is_floating_point:
        raise ValueError(
            f"selective_scan_triton: cu_seqlens must be a 1-d integer tensor [documents + 1], got "
            f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        )
    devices = {tensor.device for tensor in (u, delta, A, B, C, cu_seqlens)}
    if len(devices) != 1:
        raise ValueError(f"selective_scan_triton: all inputs must be on one device, got {sorted(map(str, devices))}")
