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

from blockzoo_ssm.triton_selective_scan_kernels import backward_kernel, forward_kernel

# Tokens between stored states: the forward keeps tokens / interval states for the backward, and each backward
# program recomputes at most this many states into its scratch buffer.
CHECKPOINT_INTERVAL = 32
# State elements per program and per thread: BLOCK_D * BLOCK_N = _TILE_ELEMENTS where the channels allow,
# num_warps = _TILE_ELEMENTS / (32 * _ELEMENTS_PER_THREAD).
_TILE_ELEMENTS = 512
_ELEMENTS_PER_THREAD = 4
# Backward programs resident per multiprocessor (each holds a scratch buffer of CHECKPOINT_INTERVAL states).
_BACKWARD_PROGRAMS_PER_SM = 8


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
                forward_kernel[(documents, channels // block_d)](
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
                backward_kernel[(lanes, blocks)](
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
