"""Depthwise causal convolution over packed documents (Mamba's conv1d), restarting at every document.

On CUDA without a generation state it runs the project's Triton kernels (`blockzoo_ssm.triton_conv`, imported only
then); otherwise the torch path here, which is also their reference.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from blockzoo.layers.base import Batch
from blockzoo_ssm.scan import positions_in_batch

ACTIVATIONS = (None, "silu")
# What the Triton kernels take (`uses_triton_kernel`, their one rule): channels a multiple of 8 (16-byte aligned
# rows), up to 8 taps (mamba's filters have 4; a longer one takes the torch path), these dtypes.
KERNEL_MAX_TAPS = 8
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    batch: Batch,
    *,
    activation: str | None = None,
    state: torch.Tensor | None = None,
    initial: torch.Tensor | None = None,
) -> torch.Tensor:
    """y_t = activation(bias + Σ_j weight[:, -1 - j] · x_{t-j}), taps before the document's first token reading 0.

    x: [tokens, channels]; weight: [channels, kernel_size] (mamba_ssm's / HF's `conv1d.weight[:, 0, :]`);
    bias: [channels] or None; activation: None or "silu". With `state` ([sequences, channels, kernel_size - 1],
    generation), taps before this batch's first token of a sequence read that sequence's stored inputs, and the
    state is overwritten in place with each sequence's last kernel_size - 1 inputs. Accumulated in fp32 (float64 for
    float64 inputs); the output has the dtype of `x`. `x` may be a slice of a wider tensor (in_proj's output): the
    Triton kernels read it in place.

    `initial` ([kernel_size - 1, channels], differentiable; slices of longer sequences): the inputs just before the
    batch's first token, read by the taps of its first document (rows that are not of that document must be zeros:
    `blockzoo_ssm.slices` masks them). Not with `state`.
    """
    _check(x, weight, bias, batch, activation, state, initial)
    if uses_triton_kernel(x, weight, state):
        return triton_causal_conv1d(x, weight, bias, batch, activation=activation, initial=initial)
    kernel_size = weight.shape[1]
    # cuDNN's depthwise conv accumulates in fp32 whatever the dtype; the CPU's accumulates in the dtype, so fp32.
    compute_dtype = x.dtype if x.is_cuda else torch.promote_types(x.dtype, torch.float32)
    rows = _state_rows(batch, kernel_size - 1)
    extended = _with_stored_inputs(x.to(compute_dtype), state, rows)
    if initial is not None and kernel_size > 1:  # the first document's stored rows
        extended = extended.index_put((rows["stored"][: kernel_size - 1],), initial.to(compute_dtype))
    # One convolution over the documents, each preceded by its kernel_size - 1 stored inputs (zeros without a
    # state), so no tap reaches into the previous document; output row r belongs to the token in extended row
    # r + kernel_size - 1.
    output = F.conv1d(
        extended.t().unsqueeze(0),
        weight.to(compute_dtype).unsqueeze(1),
        None if bias is None else bias.to(compute_dtype),
        groups=x.shape[1],
    )[0].t()[rows["tokens"] - (kernel_size - 1)]
    if state is not None and kernel_size > 1:
        with torch.no_grad():
            state.copy_(extended[rows["last"]].unflatten(0, (batch.num_documents, -1)).transpose(1, 2))
    if activation == "silu":
        output = F.silu(output)
    return output.to(x.dtype)


def uses_triton_kernel(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None) -> bool:
    """Whether `causal_conv1d` takes the Triton kernels: CUDA, no state, triton installed, channels a multiple of 8,
    at most KERNEL_MAX_TAPS taps, x in fp32, bf16 or fp16."""
    supported = x.shape[1] % 8 == 0 and weight.shape[1] <= KERNEL_MAX_TAPS and x.dtype in KERNEL_DTYPES
    return state is None and x.is_cuda and supported and _triton_installed()


def triton_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    batch: Batch,
    *,
    activation: str | None = None,
    initial: torch.Tensor | None = None,
) -> torch.Tensor:
    """`causal_conv1d`'s Triton path (no state), on CUDA or under the Triton interpreter."""
    from blockzoo_ssm.triton_conv import causal_conv1d_triton

    stored = weight.shape[1] - 1
    if initial is None or stored == 0:
        return causal_conv1d_triton(x, weight, bias, _int32_positions(batch), activation=activation)
    # The inputs before the batch go in front of it as the start of its first document; their outputs are dropped.
    extended = torch.cat([initial.to(x.dtype), x])
    positions = _int32_positions_after(batch, stored)
    return causal_conv1d_triton(extended, weight, bias, positions, activation=activation)[stored:]


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _int32_positions(batch: Batch) -> torch.Tensor:
    return batch.preprocessed(("blockzoo_ssm", "positions_in_batch", "int32"), lambda: positions_in_batch(batch).int())


def _int32_positions_after(batch: Batch, stored: int) -> torch.Tensor:
    """The positions of `stored` rows put in front of the batch, then of its tokens, the stored rows counted as the
    start of its first document."""

    def compute() -> torch.Tensor:
        positions = positions_in_batch(batch) + stored * (batch.document_index == 0)
        return torch.cat([torch.arange(stored, device=batch.device), positions]).int()

    return batch.preprocessed(("blockzoo_ssm", "positions_in_batch", "int32", "after", stored), compute)


def shifted_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    *,
    activation: str | None = None,
) -> torch.Tensor:
    """`causal_conv1d` without a state as the Triton kernels compute it, in torch ops: K shifted multiply-adds in
    fp32, each tap masked where it would reach before its token's document (`positions`: each token's position in
    its document, `positions_in_batch(batch)`). Not used by `causal_conv1d`: it is what `torch.compile` is measured
    on against the kernels (core/tests/test_triton_conv.py, the Mamba 2 layer benchmark); tensors only, so a
    compiled version does not recompile for each batch.
    """
    kernel_size = weight.shape[1]
    positions = positions[:, None]
    weight = weight.float()
    total = x.new_zeros(x.shape, dtype=torch.float32) if bias is None else bias.float().expand(x.shape)
    for j in range(kernel_size):
        shifted = F.pad(x[: len(x) - j], (0, 0, j, 0)) if j else x  # row t holds x[t - j]
        total = total + torch.where(positions >= j, shifted.float(), 0.0) * weight[:, kernel_size - 1 - j]
    return (F.silu(total) if activation == "silu" else total).to(x.dtype)


def _state_rows(batch: Batch, stored: int) -> dict[str, torch.Tensor]:
    """Row indices of the extended sequence where each document is preceded by `stored` rows (its cached inputs)."""

    def compute() -> dict[str, torch.Tensor]:
        documents = torch.arange(batch.num_documents, device=batch.device)
        offsets = torch.arange(stored, device=batch.device)
        first = batch.cu_seqlens[:-1].to(torch.int64) + documents * stored
        end = batch.cu_seqlens[1:].to(torch.int64) + (documents + 1) * stored
        return {
            "tokens": torch.arange(batch.num_tokens, device=batch.device) + (batch.document_index + 1) * stored,
            "stored": (first[:, None] + offsets).flatten(),
            "last": (end[:, None] - stored + offsets).flatten(),
        }

    return batch.preprocessed(("blockzoo_ssm", "conv_state_rows", stored), compute)


def _with_stored_inputs(x: torch.Tensor, state: torch.Tensor | None, rows: dict[str, torch.Tensor]) -> torch.Tensor:
    extended = x.new_zeros(len(rows["tokens"]) + len(rows["stored"]), x.shape[1])
    extended = extended.index_put((rows["tokens"],), x)
    if state is None or state.shape[-1] == 0:
        return extended
    stored = state.detach().transpose(1, 2).flatten(0, 1).to(x.dtype)
    return extended.index_put((rows["stored"],), stored)


def _check(x, weight, bias, batch, activation, state, initial) -> None:
    if x.ndim != 2 or x.shape[0] != batch.num_tokens:
        raise ValueError(f"causal_conv1d: x must be [tokens={batch.num_tokens}, channels], got {tuple(x.shape)}")
    channels = x.shape[1]
    if weight.ndim != 2 or weight.shape[0] != channels or weight.shape[1] < 1:
        raise ValueError(f"causal_conv1d: weight must be [channels={channels}, kernel_size], got {tuple(weight.shape)}")
    if bias is not None and bias.shape != (channels,):
        raise ValueError(f"causal_conv1d: bias must be [channels={channels}], got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal_conv1d: activation must be one of {ACTIVATIONS}, got {activation!r}")
    expected = (batch.num_documents, channels, weight.shape[1] - 1)
    if state is not None and tuple(state.shape) != expected:
        raise ValueError(
            f"causal_conv1d: state must be [sequences, channels, kernel_size - 1] = {expected}, "
            f"got {tuple(state.shape)}"
        )
    if initial is not None and state is not None:
        raise ValueError("causal_conv1d: give `initial` (a slice's preceding inputs) or `state` (generation), not both")
    if initial is not None and tuple(initial.shape) != (weight.shape[1] - 1, channels):
        raise ValueError(
            f"causal_conv1d: initial must be [kernel_size - 1, channels] = {(weight.shape[1] - 1, channels)}, "
            f"got {tuple(initial.shape)}"
        )
