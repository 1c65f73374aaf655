"""Depthwise causal convolution over packed documents (Mamba's conv1d), restarting at every document."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blockzoo.layers.base import Batch

ACTIVATIONS = (None, "silu")


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    batch: Batch,
    *,
    activation: str | None = None,
    state: torch.Tensor | None = None,
) -> torch.Tensor:
    """y_t = activation(bias + Σ_j weight[:, -1 - j] · x_{t-j}), taps before the document's first token reading 0.

    x: [tokens, channels]; weight: [channels, kernel_size] (mamba_ssm's / HF's `conv1d.weight[:, 0, :]`);
    bias: [channels] or None; activation: None or "silu". With `state` ([sequences, channels, kernel_size - 1],
    generation), taps before this batch's first token of a sequence read that sequence's stored inputs, and the
    state is overwritten in place with each sequence's last kernel_size - 1 inputs. Accumulated in fp32 (float64 for
    float64 inputs); the output has the dtype of `x`.
    """
    _check(x, weight, bias, batch, activation, state)
    kernel_size = weight.shape[1]
    # cuDNN's depthwise conv accumulates in fp32 whatever the dtype; the CPU's accumulates in the dtype, so fp32.
    compute_dtype = x.dtype if x.is_cuda else torch.promote_types(x.dtype, torch.float32)
    rows = _state_rows(batch, kernel_size - 1)
    extended = _with_stored_inputs(x.to(compute_dtype), state, rows)
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

    return batch.preprocessed(("blockzoo.ssm", "conv_state_rows", stored), compute)


def _with_stored_inputs(x: torch.Tensor, state: torch.Tensor | None, rows: dict[str, torch.Tensor]) -> torch.Tensor:
    extended = x.new_zeros(len(rows["tokens"]) + len(rows["stored"]), x.shape[1])
    extended = extended.index_put((rows["tokens"],), x)
    if state is None or state.shape[-1] == 0:
        return extended
    stored = state.detach().transpose(1, 2).flatten(0, 1).to(x.dtype)
    return extended.index_put((rows["stored"],), stored)


def _check(x, weight, bias, batch, activation, state) -> None:
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
