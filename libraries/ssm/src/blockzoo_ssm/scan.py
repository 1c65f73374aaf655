"""The SSM scans over packed documents: `ssd_scan` (Mamba 2 / SSD) and `selective_scan` (Mamba 1).

Each dispatches to a GPU kernel when it can (CUDA, no generation state): mamba_ssm's Triton SSD kernel, or the
project's own Triton selective scan. Otherwise it runs the torch path here, in fp32 (float64 for float64 inputs):
- SSD, chunked: each document is padded to a multiple of the chunk length; within a chunk the output is a masked
  quadratic form, and the state at each chunk's end is passed on to the next chunk of the same document;
- selective scan, exact: a sequential loop over time over the documents padded to the longest one.
Padding has dt = 0 and x = 0, which leaves the state unchanged, so a padded document ends in its true final state.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from blockzoo.layers.base import Batch
from blockzoo_ssm.kernels import mamba_chunk_scan, mamba_ssm_available


def positions_in_batch(batch: Batch) -> torch.Tensor:
    """Each token's position among its document's tokens in this batch (0 at the document's first token here,
    whatever a generation cache already holds)."""

    def compute() -> torch.Tensor:
        starts = batch.cu_seqlens[:-1].to(torch.int64)[batch.document_index]
        return torch.arange(batch.num_tokens, device=batch.device) - starts

    return batch.preprocessed(("blockzoo_ssm", "positions_in_batch"), compute)


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    batch: Batch,
    *,
    chunk_size: int,
    D: torch.Tensor | None = None,
    scale_input: bool = True,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    state: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    return_final_state: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Mamba 2's scan: per document, s_t = exp(dt_t·A)·s_{t-1} + (dt_t if scale_input else 1)·x_t ⊗ B_t and
    y_t = s_t · C_t (+ D·x_t with a skip `D`: [heads], or [heads, head_size] for one per channel; fused into the
    kernel on CUDA).

    x: [tokens, heads, head_size]; dt: [tokens, heads] (positive); A: [heads] (negative); B, C: [tokens, groups,
    state_size], head h reading group h // (heads // groups). No gate. With `dt_bias` ([heads]), `dt_softplus` or a
    `dt_limit` other than [0, inf], the time step is `time_step(dt, dt_bias, dt_softplus, dt_limit)` (Mamba 2's
    clamp(softplus(dt + dt_bias))), computed inside the kernel on CUDA, so dt may be in_proj's raw output.
    `state` (generation): None or [sequences, heads, head_size, state_size], the initial state, overwritten in
    place with the final one. Returns y [tokens, heads, head_size] in the dtype of x.

    Slices of longer sequences (differentiable, every path): `initial_state` [heads, head_size, state_size], the
    state the batch's first document starts from (None: zeros); `return_final_state`: return (y, the state after the
    batch's last token [heads, head_size, state_size], fp32 or float64 for float64 inputs). Neither with `state`.
    """
    _check_ssd(x, dt, A, B, C, batch, chunk_size, state)
    _check_slice_states("ssd_scan", state, initial_state, return_final_state, (*x.shape[1:], B.shape[2]))
    if D is not None and D.shape not in ((x.shape[1],), x.shape[1:]):
        raise ValueError(
            f"ssd_scan: D must be [heads] or [heads, head_size] of x {tuple(x.shape)}, got {tuple(D.shape)}"
        )
    if dt_bias is not None and dt_bias.shape != (x.shape[1],):
        raise ValueError(f"ssd_scan: dt_bias must be [heads] = ({x.shape[1]},), got {tuple(dt_bias.shape)}")
    if not dt_limit[0] < dt_limit[1]:
        raise ValueError(f"ssd_scan: dt_limit must be (min, max) with min < max, got {tuple(dt_limit)}")
    kernel = state is None and x.is_cuda and mamba_ssm_available()
    states = {"initial_state": initial_state, "return_final_state": return_final_state}
    if kernel and scale_input:  # the kernel turns dt into the time step itself
        return mamba_chunk_scan(
            x,
            dt,
            A,
            B,
            C,
            _int32_document_index(batch),
            chunk_size=chunk_size,
            D=D,
            scale_input=True,
            dt_bias=dt_bias,
            dt_softplus=dt_softplus,
            dt_limit=dt_limit,
            **states,
        )
    dt = time_step(dt, dt_bias, dt_softplus, dt_limit)
    if kernel:  # not scale_input: the kernel is given x / dt, which needs the time step itself
        return mamba_chunk_scan(
            x, dt, A, B, C, _int32_document_index(batch), chunk_size=chunk_size, D=D, scale_input=False, **states
        )
    y, final = _chunked_ssd(
        x, dt, A, B, C, batch, chunk_size=chunk_size, scale_input=scale_input, state=state, initial=initial_state
    )
    if D is not None:
        dtype = torch.promote_types(y.dtype, torch.float32)
        skip = D.to(dtype) if D.ndim == 2 else D.to(dtype)[:, None]
        y = (y.to(dtype) + skip * x.to(dtype)).to(y.dtype)
    return (y, final[-1]) if return_final_state else y


def _int32_document_index(batch: Batch) -> torch.Tensor:
    """The kernel's `seq_idx` (each token's document), cast once per batch."""
    return batch.preprocessed(("blockzoo_ssm", "document_index", "int32"), lambda: batch.document_index.int())


def time_step(
    dt: torch.Tensor,
    dt_bias: torch.Tensor | None = None,
    softplus: bool = False,
    limit: tuple[float, float] = (0.0, math.inf),
) -> torch.Tensor:
    """clamp(softplus(dt + dt_bias), *limit), each part where asked, in fp32 (float64 for float64 dt) as mamba_ssm's
    kernels compute it (torch's softplus, like theirs, is the identity above 20). Without any, dt as it is."""
    if dt_bias is None and not softplus and tuple(limit) == (0.0, math.inf):
        return dt
    dt = dt.to(torch.promote_types(dt.dtype, torch.float32))
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if softplus:
        dt = F.softplus(dt)
    return dt if tuple(limit) == (0.0, math.inf) else dt.clamp(*limit)


def selective_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    batch: Batch,
    *,
    state: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    return_final_state: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Mamba 1's scan: per document, s_t = exp(delta_t·A)·s_{t-1} + delta_t·u_t·B_t and y_t = s_t · C_t.

    u, delta: [tokens, channels] (delta positive); A: [channels, state_size] (negative); B, C: [tokens, groups,
    state_size], channel d reading group d // (channels // groups). No D skip and no gate. `state` (generation):
    None or [sequences, channels, state_size], updated in place. Returns y [tokens, channels] in the dtype of u.

    Slices of longer sequences (differentiable, every path): `initial_state` [channels, state_size], the state the
    batch's first document starts from (None: zeros); `return_final_state`: return (y, the state after the batch's
    last token [channels, state_size], fp32 or float64 for float64 inputs). Neither with `state`.
    """
    _check_selective(u, delta, A, B, C, batch, state)
    _check_slice_states("selective_scan", state, initial_state, return_final_state, tuple(A.shape))
    if state is None and u.is_cuda:
        from blockzoo_ssm.triton_selective_scan import selective_scan_triton

        if initial_state is None and not return_final_state:
            return selective_scan_triton(u, delta, A, B, C, batch.cu_seqlens)
        initial_states = None if initial_state is None else _first_document_only(initial_state.float(), batch)
        y, finals = selective_scan_triton(
            u, delta, A, B, C, batch.cu_seqlens, initial_states=initial_states, return_final_states=True
        )
    else:
        y, finals = _sequential_selective_scan(u, delta, A, B, C, batch, state=state, initial=initial_state)
    return (y, finals[-1]) if return_final_state else y


def _first_document_only(initial_state: torch.Tensor, batch: Batch) -> torch.Tensor:
    """[documents, ...]: `initial_state` for the first document, zeros for the others."""
    others = initial_state.new_zeros(batch.num_documents - 1, *initial_state.shape)
    return torch.cat([initial_state[None], others])


# ---------------------------------------------------------------------------------------------------------------------
# SSD, chunked


def _chunked_ssd(x, dt, A, B, C, batch, *, chunk_size, scale_input, state, initial):
    """(y, each document's final state [documents, heads, head_size, state] in fp32 or float64)."""
    output_dtype, dtype = x.dtype, torch.promote_types(x.dtype, torch.float32)
    # A chunk longer than every document would only add padding.
    layout = _chunk_layout(batch, min(chunk_size, batch.max_length))
    heads, head_size = x.shape[1:]
    groups = B.shape[1]
    per_group = (groups, heads // groups)

    def chunked(tensor: torch.Tensor) -> torch.Tensor:
        padded = tensor.new_zeros((layout["padded_tokens"], *tensor.shape[1:]), dtype=dtype)
        return padded.index_put((layout["rows"],), tensor.to(dtype)).unflatten(0, (layout["chunks"], -1))

    x, dt, B, C = chunked(x), chunked(dt), chunked(B), chunked(C)  # [chunks, length, ...]
    inputs = (x * dt.unsqueeze(-1) if scale_input else x).unflatten(2, per_group)  # [n, l, g, r, p]
    log_decay = (dt * A.to(dtype)).transpose(1, 2)  # [chunks, heads, length]: log of each step's decay

    # Within each chunk: y_i = Σ_{j<=i} exp(Σ_{j<k<=i} log_decay_k) (C_i · B_j) inputs_j.
    decay = torch.exp(_segment_sums(log_decay))  # [n, h, i, j]
    scores = torch.einsum("nigs,njgs->ngij", C, B)
    y = torch.einsum("ngrij,njgrp->nigrp", decay.unflatten(1, per_group) * scores.unsqueeze(2), inputs)

    # What each chunk adds to the state at its end, then the states entering each chunk.
    to_end = decay[..., -1, :].unflatten(1, per_group).permute(0, 3, 1, 2)  # [n, j, g, r]
    chunk_states = torch.einsum("njgrp,njgs->ngrps", inputs * to_end.unsqueeze(-1), B).flatten(1, 2)
    if state is not None:
        initial = state.to(dtype, copy=True)  # a copy: `state` is overwritten below
    elif initial is not None:
        initial = _first_document_only(initial.to(dtype), batch)
    else:
        initial = x.new_zeros(batch.num_documents, heads, head_size, B.shape[-1])
    entering, final = _pass_states(chunk_states, log_decay.sum(-1).exp(), initial, layout)

    # From the entering state: y_i += exp(Σ_{k<=i} log_decay_k) (C_i · s).
    from_start = log_decay.cumsum(-1).exp().unflatten(1, per_group).permute(0, 3, 1, 2)  # [n, i, g, r]
    y = y + torch.einsum("nigs,ngrps->nigrp", C, entering.unflatten(1, per_group)) * from_start.unsqueeze(-1)
    if state is not None:
        state.copy_(final.detach())
    return y.flatten(0, 1)[layout["rows"]].flatten(1, 2).to(output_dtype), final


def _segment_sums(values: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L, L]: entry (i, j) is Σ_{j<k<=i} values_k, -inf above the diagonal (j > i).

    Summed directly rather than as a difference of cumulative sums, which would lose precision in fp32."""
    length = values.shape[-1]
    ones = torch.ones(length, length, dtype=torch.bool, device=values.device)
    repeated = values.unsqueeze(-1).expand(*values.shape, length)  # [..., k, j] = values_k
    sums = repeated.masked_fill(~ones.tril(-1), 0).cumsum(-2)
    return sums.masked_fill(~ones.tril(), float("-inf"))


def _pass_states(chunk_states, chunk_decay, initial, layout):
    """The state entering each chunk, and each document's final state: s <- decay_c · s + chunk_states_c along the
    chunks of each document, starting from `initial` [documents, ...]."""
    # A spare all-zero chunk (decay 1) fills the table of documents with fewer chunks than the longest.
    chunk_states = torch.cat([chunk_states, chunk_states.new_zeros(1, *chunk_states.shape[1:])])
    chunk_decay = torch.cat([chunk_decay, chunk_decay.new_ones(1, *chunk_decay.shape[1:])])
    table = layout["table"]  # [documents, most chunks]: chunk ids
    # Unbound once: indexing one chunk per step would make the backward pass fill a full-size gradient each step.
    states, decays = chunk_states[table].unbind(1), chunk_decay[table][..., None, None].unbind(1)
    state, entering = initial, []
    for added, decay in zip(states, decays):
        entering.append(state)
        state = decay * state + added
    entering = torch.stack(entering, 1)[layout["chunk_document"], layout["chunk_index"]]
    return entering, state


def _chunk_layout(batch: Batch, length: int) -> dict:
    """Where each token goes when every document is padded to a multiple of `length` and cut into chunks."""

    def compute() -> dict:
        chunks_per_document = (batch.lengths + length - 1) // length
        first_chunk = torch.nn.functional.pad(chunks_per_document.cumsum(0), (1, 0))
        chunks = int(first_chunk[-1])
        chunk_document = torch.repeat_interleave(
            torch.arange(batch.num_documents, device=batch.device), chunks_per_document
        )
        index = torch.arange(int(chunks_per_document.max()), device=batch.device)
        table = first_chunk[:-1, None] + index
        return {
            "rows": first_chunk[batch.document_index] * length + positions_in_batch(batch),
            "chunks": chunks,
            "padded_tokens": chunks * length,
            "chunk_document": chunk_document,
            "chunk_index": torch.arange(chunks, device=batch.device) - first_chunk[chunk_document],
            "table": torch.where(index < chunks_per_document[:, None], table, chunks),
        }

    return batch.preprocessed(("blockzoo_ssm", "chunks", length), compute)


# ---------------------------------------------------------------------------------------------------------------------
# Selective scan, sequential


def _sequential_selective_scan(u, delta, A, B, C, batch, *, state, initial):
    """(y, each document's final state [documents, channels, state] in fp32 or float64)."""
    output_dtype, dtype = u.dtype, torch.promote_types(u.dtype, torch.float32)
    rows = _padded_rows(batch)
    documents, length = batch.num_documents, batch.max_length
    groups = B.shape[1]

    def padded(tensor: torch.Tensor) -> torch.Tensor:
        empty = tensor.new_zeros((documents * length, *tensor.shape[1:]), dtype=dtype)
        return empty.index_put((rows,), tensor.to(dtype)).unflatten(0, (documents, length))

    u, delta, B, C = padded(u), padded(delta), padded(B), padded(C)  # [documents, length, ...]
    decay = torch.exp(delta.unsqueeze(-1) * A.to(dtype))  # [d, l, channels, state]
    inputs = ((delta * u).unflatten(-1, (groups, -1)).unsqueeze(-1) * B.unsqueeze(3)).flatten(2, 3)
    if state is not None:
        current = state.to(dtype, copy=True)
    elif initial is not None:
        current = _first_document_only(initial.to(dtype), batch)
    else:
        current = decay.new_zeros(documents, *A.shape)
    states = []
    # Unbound once: indexing one step at a time would make the backward pass fill a full-size gradient each step.
    for step_decay, step_input in zip(decay.unbind(1), inputs.unbind(1)):
        current = step_decay * current + step_input
        states.append(current)
    y = torch.einsum("dlgrs,dlgs->dlgr", torch.stack(states, 1).unflatten(2, (groups, -1)), C).flatten(2)
    if state is not None:
        state.copy_(current.detach())
    return y.flatten(0, 1)[rows].to(output_dtype), current


def _padded_rows(batch: Batch) -> torch.Tensor:
    """Each token's row when the documents are padded to the longest one and stacked."""
    return batch.preprocessed(
        ("blockzoo_ssm", "padded_rows"), lambda: batch.document_index * batch.max_length + positions_in_batch(batch)
    )


# ---------------------------------------------------------------------------------------------------------------------
# Checks


def _check_ssd(x, dt, A, B, C, batch, chunk_size, state) -> None:
    tokens = batch.num_tokens
    if x.ndim != 3 or x.shape[0] != tokens:
        raise ValueError(f"ssd_scan: x must be [tokens={tokens}, heads, head_size], got {tuple(x.shape)}")
    heads, head_size = x.shape[1:]
    if dt.shape != (tokens, heads):
        raise ValueError(f"ssd_scan: dt must be [tokens, heads] = {(tokens, heads)}, got {tuple(dt.shape)}")
    if A.shape != (heads,):
        raise ValueError(f"ssd_scan: A must be [heads] = ({heads},), got {tuple(A.shape)}")
    if B.ndim != 3 or B.shape[0] != tokens or C.shape != B.shape:
        raise ValueError(
            f"ssd_scan: B and C must both be [tokens={tokens}, groups, state_size], got {tuple(B.shape)} and "
            f"{tuple(C.shape)}"
        )
    if heads % B.shape[1] != 0:
        raise ValueError(f"ssd_scan: the groups of B and C ({B.shape[1]}) must divide the heads ({heads})")
    if chunk_size < 1:
        raise ValueError(f"ssd_scan: chunk_size must be >= 1, got {chunk_size}")
    expected = (batch.num_documents, heads, head_size, B.shape[2])
    if state is not None and tuple(state.shape) != expected:
        raise ValueError(
            f"ssd_scan: state must be [sequences, heads, head_size, state_size] = {expected}, got {tuple(state.shape)}"
        )


def _check_slice_states(function, state, initial_state, return_final_state, shape) -> None:
    if state is not None and (initial_state is not None or return_final_state):
        raise ValueError(
            f"{function}: give `state` (generation) or `initial_state` / `return_final_state` (a slice), not both"
        )
    if initial_state is not None and tuple(initial_state.shape) != shape:
        raise ValueError(f"{function}: initial_state must be {shape}, got {tuple(initial_state.shape)}")


def _check_selective(u, delta, A, B, C, batch, state) -> None:
    tokens = batch.num_tokens
    if u.ndim != 2 or u.shape[0] != tokens:
        raise ValueError(f"selective_scan: u must be [tokens={tokens}, channels], got {tuple(u.shape)}")
    if delta.shape != u.shape:
        raise ValueError(f"selective_scan: delta must have u's shape {tuple(u.shape)}, got {tuple(delta.shape)}")
    channels = u.shape[1]
    if A.ndim != 2 or A.shape[0] != channels:
        raise ValueError(f"selective_scan: A must be [channels={channels}, state_size], got {tuple(A.shape)}")
    if B.ndim != 3 or B.shape[0] != tokens or B.shape[2] != A.shape[1] or C.shape != B.shape:
        raise ValueError(
            f"selective_scan: B and C must both be [tokens={tokens}, groups, state_size={A.shape[1]}], got "
            f"{tuple(B.shape)} and {tuple(C.shape)}"
        )
    if channels % B.shape[1] != 0:
        raise ValueError(f"selective_scan: the groups of B and C ({B.shape[1]}) must divide the channels ({channels})")
    if state is not None and tuple(state.shape) != (batch.num_documents, *A.shape):
        raise ValueError(
            f"selective_scan: state must be [sequences, channels, state_size] = {(batch.num_documents, *A.shape)}, "
            f"got {tuple(state.shape)}"
        )
