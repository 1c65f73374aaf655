"""The gated delta rule over packed documents: a torch chunked (WY) form, a one-token recurrent step, and the
dispatch to a kernel on CUDA (blockzoo's own Triton kernels, `triton_delta_rule`, or flash-linear-attention's).

Per value head, with the state S [key_head_size, value_head_size] (fla's and HF's layout):

    S_t = α_t (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ,    o_t = S_tᵀ q_t

(the transpose of the brief's S_t = α_t S_{t-1} (I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ, o_t = S_t q_t). q and k are
L2-normalised here, q is scaled by key_head_size^-0.5; the state restarts at every document.

The chunked form: within a chunk starting from S_0, with γ_t = Π_{s ≤ t} α_s, the "new values" u_t = β_t (v_t −
(α_t S_{t-1})ᵀ k_t) solve the unit lower-triangular system (I + L) u = β v − β γ K S_0, L[t, s] = β_t (γ_t / γ_s)
k_tᵀ k_s for s < t. So u = U − W S_0 with U = (I + L)⁻¹ β v and W = (I + L)⁻¹ β γ K (the WY / UT transform), and
    O = (γ Q) S_0 + ((Q Kᵀ) ⊙ Γ) u,    S_C = γ_C S_0 + (K ⊙ γ_C / γ)ᵀ u,    Γ[t, s] = γ_t / γ_s for s ≤ t.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import os
import warnings

import torch

from blockzoo.api import Batch
from blockzoo_ssm.scan import positions_in_batch  # computed once per batch, shared with the convolution

L2_NORM_EPSILON = 1.0e-6  # Qwen3-Next's and fla's: x · rsqrt(Σ x² + ε)


def _imports(package: str, module: str, failure: str) -> bool:
    """Whether `module` imports when `package` is installed; an installed one that fails is said once (`failure`:
    what is installed and what is taken instead)."""
    if importlib.util.find_spec(package) is None:
        return False
    try:
        importlib.import_module(module)
    except ImportError as error:
        warnings.warn(f"{failure} ({type(error).__name__}: {error})", stacklevel=3)
        return False
    return True


@functools.cache
def fla_available() -> bool:
    """Whether flash-linear-attention's chunked gated delta rule imports, checked once per process."""
    return _imports(
        "fla",
        "fla.ops.gated_delta_rule",
        "flash-linear-attention is installed but does not import; gated_delta_net uses its torch path",
    )


@functools.cache
def fla_backward_refused() -> bool:
    """Whether fla refuses the gated backward pass on this GPU: fla 0.6 raises on Hopper with Triton >= 3.4 and
    < 3.7.1 (its issue #640: wrong results) unless tilelang is installed, which it then uses instead."""
    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except ImportError:  # a version without these flags has no such check
        return False
    no_tilelang = importlib.util.find_spec("tilelang") is None
    return bool(IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1 and no_tilelang)


KERNEL_VARIABLE = "BLOCKZOO_GATED_DELTA_NET_KERNEL"
KERNELS = ("auto", "fla", "triton", "torch")


@functools.cache
def triton_kernel_available() -> bool:
    """Whether blockzoo's own Triton kernels (`triton_delta_rule`) import, checked once per process."""
    return _imports(
        "triton",
        "blockzoo_gated_delta_net.triton_delta_rule",
        "triton is installed but blockzoo's Gated DeltaNet kernels do not import; gated_delta_net uses fla's kernel "
        "or its torch path",
    )


def _triton_takes(q: torch.Tensor, v: torch.Tensor, chunk_size: int) -> bool:
    from blockzoo_gated_delta_net.triton_delta_rule import supports

    return supports(q.shape[-1], v.shape[-1], chunk_size)


def choose_kernel(q: torch.Tensor, v: torch.Tensor, *tensors: torch.Tensor, chunk_size: int = 64) -> str:
    """Which kernel `gated_delta_rule` takes for a chunked pass (one-token generation steps take the recurrence):
    "fla", "triton" (blockzoo's own) or "torch".

    On the CPU, torch. On CUDA, flash-linear-attention's kernel wherever it may run: installed, and, when a gradient
    will be wanted of the inputs, its backward not refused (fla 0.6 refuses it on Hopper with Triton 3.6); else
    blockzoo's Triton kernels (chunks of 16, 32 or 64 tokens, key heads of 16 to 128 channels, value heads of at
    least 16); else torch. fla first where both may run (its kernels autotune their launches on each GPU; ours
    have been timed against them on an H100 only). The environment variable
    BLOCKZOO_GATED_DELTA_NET_KERNEL=fla|triton|torch forces one (a kernel that cannot run here raises); "triton" also
    runs on CPU tensors under TRITON_INTERPRET=1 (the tests)."""
    forced = os.environ.get(KERNEL_VARIABLE, "auto")
    if forced not in KERNELS:
        raise ValueError(f"{KERNEL_VARIABLE}={forced!r}: expected one of {', '.join(KERNELS)}")
    if forced == "auto" and not q.is_cuda:
        return "torch"
    wants_gradient = torch.is_grad_enabled() and any(tensor.requires_grad for tensor in (q, v, *tensors))
    fla_runs = q.is_cuda and fla_available() and not (wants_gradient and fla_backward_refused())
    triton_here = q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    ours_runs = triton_here and triton_kernel_available() and _triton_takes(q, v, chunk_size)
    if forced != "auto":
        runs = {"fla": fla_runs, "triton": ours_runs, "torch": True}[forced]
        if not runs:
            raise ValueError(f"{KERNEL_VARIABLE}={forced}: that kernel cannot run here (not installed or refused)")
        return forced
    return "fla" if fla_runs else "triton" if ours_runs else "torch"


def uses_fla_kernel(q: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Whether `gated_delta_rule` takes flash-linear-attention's kernel (but for one-token generation steps)."""
    return choose_kernel(q, *(tensors or (q,))) == "fla"


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + L2_NORM_EPSILON)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    batch: Batch,
    *,
    chunk_size: int = 64,
    state: torch.Tensor | None = None,
) -> torch.Tensor:
    """o [tokens, value_heads, value_head_size] of the gated delta rule over the documents of `batch`.

    q, k: [tokens, key_heads, key_head_size] before the L2 norm; v: [tokens, value_heads, value_head_size]; g: the
    log decay log α [tokens, value_heads] (fp32); beta: [tokens, value_heads]. Value head h reads key head
    h // (value_heads / key_heads). `state` ([sequences, value_heads, key_head_size, value_head_size], fp32;
    generation): each sequence starts from its state, which is overwritten in place with the state after the
    batch. Computed in fp32 (float64 for float64 inputs) on the torch path; the output has the dtype of `v`.
    """
    _check(q, k, v, g, beta, batch, state)
    if state is not None and batch.max_length == 1:  # decoding: the recurrence itself, on any device
        dtype = torch.promote_types(v.dtype, torch.float32)
        q, k = _normalized_per_value_head(q, k, v, dtype)
        output, final = recurrent_step(q, k, v.to(dtype), g.to(dtype), beta.to(dtype), state.detach().to(dtype))
        output = output.to(v.dtype)
    else:
        initial = None if state is None else state.detach()
        output, final = gated_delta_rule_from(q, k, v, g, beta, batch, chunk_size=chunk_size, initial=initial)
    if state is not None:
        with torch.no_grad():
            state.copy_(final)
    return output


def gated_delta_rule_from(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    batch: Batch,
    *,
    chunk_size: int = 64,
    initial: torch.Tensor | None = None,
    kernel: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, final states [documents, value_heads, key_head_size, value_head_size]) of the chunked gated delta rule,
    each document from its `initial` state (None: zeros), differentiable in every input and in `initial` (what a
    slice of a longer sequence needs); on `kernel` ("fla", "triton" or "torch"; None: as `choose_kernel` picks).
    Inputs as `gated_delta_rule`'s; o has v's dtype, the final states fp32 (float64 for float64 inputs)."""
    if kernel is None:
        kernel = choose_kernel(q, v, k, g, beta, *([] if initial is None else [initial]), chunk_size=chunk_size)
    if kernel == "fla":
        return _fla_gated_delta_rule(q, k, v, g, beta, batch, initial)
    if kernel == "triton":
        return _triton_gated_delta_rule(q, k, v, g, beta, batch, initial, chunk_size)
    dtype = torch.promote_types(v.dtype, torch.float32)
    q, k = _normalized_per_value_head(q, k, v, dtype)
    output, final = chunked_gated_delta_rule(
        q,
        k,
        v.to(dtype),
        g.to(dtype),
        beta.to(dtype),
        batch,
        chunk_size=chunk_size,
        initial=None if initial is None else initial.to(dtype),
    )
    return output.to(v.dtype), final


def _normalized_per_value_head(q, k, v, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k L2-normalised in `dtype`, q scaled, repeated to one per value head."""
    repeat = v.shape[1] // k.shape[1]
    q, k = (l2_normalize(x.to(dtype)).repeat_interleave(repeat, dim=1) for x in (q, k))
    return q * q.shape[-1] ** -0.5, k


def recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each sequence (token i is sequence i's), q and k normalised, scaled and per value head: (o, S)."""
    state = initial * g.exp()[..., None, None]
    remembered = torch.einsum("nhkv,nhk->nhv", state, k)
    state = state + k[..., :, None] * (beta[..., None] * (v - remembered))[..., None, :]
    return torch.einsum("nhkv,nhk->nhv", state, q), state


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    batch: Batch,
    *,
    chunk_size: int,
    initial: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked (WY) form over packed documents, q and k normalised, scaled and per value head, all in one dtype:
    (o [tokens, heads, value_head_size], final states [documents, heads, key_head_size, value_head_size]).

    The documents are laid out padded, [documents, heads, chunks, chunk_size, ...]; padding follows each document
    with k = v = β = 0 and no decay, so it changes neither the outputs nor the final states."""
    documents, heads, key_size, value_size = batch.num_documents, v.shape[1], k.shape[-1], v.shape[-1]
    chunks = math.ceil(batch.max_length / chunk_size)
    rows = (batch.document_index, positions_in_batch(batch))

    def padded(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(documents, chunks * chunk_size, *x.shape[1:]).index_put(rows, x)
        return out.unflatten(1, (chunks, chunk_size)).movedim(3, 1)  # [documents, heads, chunks, chunk_size, ...]

    q, k, v, g, beta = (padded(x) for x in (q, k, v, g, beta))
    log_decay = g.cumsum(-1)  # log γ_t within each chunk
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # Γ[t, s] = γ_t / γ_s for s <= t (masked before the exp: above the diagonal the difference may overflow).
    ratio = torch.where(causal, log_decay[..., :, None] - log_decay[..., None, :], -math.inf).exp()
    lower = (beta[..., None] * (k @ k.transpose(-1, -2)) * ratio).tril(-1)
    system = lower + torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    right = torch.cat([beta[..., None] * v, (beta * log_decay.exp())[..., None] * k], dim=-1)
    u_values, w_keys = torch.linalg.solve_triangular(system, right, upper=False, unitriangular=True).split(
        [value_size, key_size], dim=-1
    )
    scores = (q @ k.transpose(-1, -2)) * ratio
    decayed_q = q * log_decay.exp()[..., None]
    last = log_decay[..., -1:]
    to_end = k * (last - log_decay).exp()[..., None]
    chunk_decay = last.exp()[..., None]

    state = q.new_zeros(documents, heads, key_size, value_size) if initial is None else initial
    # Only the state passes from chunk to chunk; the outputs of all chunks are computed together afterwards.
    # unbind, not indexing: each indexed chunk's backward would write a whole zero tensor (quadratic in chunks).
    starting_states, new_values = [], []
    per_chunk = (x.unbind(2) for x in (u_values, w_keys, chunk_decay, to_end.transpose(-1, -2)))
    for u_chunk, w_chunk, decay, to_end_chunk in zip(*per_chunk, strict=True):
        starting_states.append(state)
        u = u_chunk - w_chunk @ state
        new_values.append(u)
        state = decay * state + to_end_chunk @ u
    output = decayed_q @ torch.stack(starting_states, dim=2) + scores @ torch.stack(new_values, dim=2)
    output = output.flatten(2, 3).transpose(1, 2)  # [documents, padded length, heads, size]
    return output[rows], state


def _fla_gated_delta_rule(q, k, v, g, beta, batch, initial) -> tuple[torch.Tensor, torch.Tensor]:
    """flash-linear-attention's Triton kernel over the packed documents (its varlen form: one row, cu_seqlens)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    output, final = chunk_gated_delta_rule(
        q.unsqueeze(0).contiguous(),
        k.unsqueeze(0).contiguous(),
        v.unsqueeze(0).contiguous(),
        g.float().unsqueeze(0).contiguous(),
        beta.to(v.dtype).unsqueeze(0).contiguous(),
        scale=q.shape[-1] ** -0.5,
        initial_state=initial,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=batch.cu_seqlens.long(),
    )
    return output[0], final


def _triton_gated_delta_rule(q, k, v, g, beta, batch, initial, chunk_size) -> tuple[torch.Tensor, torch.Tensor]:
    """blockzoo's Triton kernels: q and k normalised (in fp32, stored in their dtype) and q scaled here."""
    from blockzoo_gated_delta_net.triton_delta_rule import triton_gated_delta_rule

    q = (l2_normalize(q.float()) * q.shape[-1] ** -0.5).to(q.dtype)
    k = l2_normalize(k.float()).to(k.dtype)
    return triton_gated_delta_rule(q, k, v, g.float(), beta, batch.cu_seqlens, initial, chunk_size=chunk_size)


def _check(q, k, v, g, beta, batch, state) -> None:
    tokens = batch.num_tokens
    if q.ndim != 3 or q.shape[0] != tokens or k.shape != q.shape:
        raise ValueError(
            f"gated_delta_rule: q and k must be [tokens={tokens}, key_heads, key_head_size], got {tuple(q.shape)} "
            f"and {tuple(k.shape)}"
        )
    if v.ndim != 3 or v.shape[0] != tokens or v.shape[1] % q.shape[1]:
        raise ValueError(
            f"gated_delta_rule: v must be [tokens={tokens}, value_heads (a multiple of {q.shape[1]}), "
            f"value_head_size], got {tuple(v.shape)}"
        )
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != v.shape[:2]:
            raise ValueError(f"gated_delta_rule: {name} must be [tokens, value_heads] = {tuple(v.shape[:2])}")
    expected = (batch.num_documents, v.shape[1], q.shape[2], v.shape[2])
    if state is not None and tuple(state.shape) != expected:
        raise ValueError(
            f"gated_delta_rule: state must be [sequences, value_heads, key_head_size, value_head_size] = {expected}, "
            f"got {tuple(state.shape)}"
        )
