"""The contract between the engine and the layers plugins provide (DESIGN.md "The mixer contract").

Packed sequences are the only layout: a micro-batch is documents concatenated along one token
dimension, hidden states are `[tokens, hidden]`, and `Batch` carries the document boundaries. Under
sequence-tensor-parallel the hidden states a layer receives and returns are this rank's contiguous
slice of the tokens, while `Batch` always describes all of them.

A mixer or MLP plugin registers a config class and an implementation class deriving from `Mixer` or
`MLP`; the engine builds it with `(config, name=..., hidden_dim=..., distributed=..., lr_scale=...)`.
What a layer can do (tensor parallel, ...) is declared on its config class (`capabilities`), so a run
it cannot do is refused before anything is built.

Slices (sequence-data parallelism, micro-sequences): a micro-batch's tokens may be cut into consecutive slices, each
described by an ordinary `Batch` of its pieces of documents (`slice_batch`) whose `sequence_data` says how the slice
relates to the others; a mixer runs a slice with `Mixer.forward_slice`, carrying what the next slice needs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.batch import IGNORE_INDEX, Batch, SequenceData, StatisticsLoss
from blockzoo.layers.config import GENERATION_CACHE
from blockzoo.layers.dims import TensorDim
from blockzoo.layers.slices import slice_batch, slice_lengths, slice_losses, slice_ranges
from blockzoo.layers.transfer import to_device, to_device_together

# `Batch` and its helpers have modules of their own; importing them from here keeps working.
__all__ = [
    "IGNORE_INDEX",
    "MLP",
    "Batch",
    "Layer",
    "Mixer",
    "SequenceData",
    "StatisticsLoss",
    "slice_batch",
    "slice_lengths",
    "slice_losses",
    "slice_ranges",
    "to_device",
    "to_device_together",
]


class Layer(nn.Module):
    """Base of mixers and MLPs: a module over packed `[tokens, hidden]` states.

    Subclasses build their parameters with `blockzoo.layers.linear.Linear` and
    `blockzoo.layers.parameter.create_parameter`, naming them under `self.name`.
    """

    def __init__(self, config: Any, *, name: str, hidden_dim: TensorDim, distributed: Distributed, lr_scale: float):
        super().__init__()
        self.config = config
        self.name = name
        self.hidden_dim = hidden_dim
        self.distributed = distributed
        self.lr_scale = lr_scale

    def forward(self, hidden: torch.Tensor, batch: Batch, state: Any = None) -> torch.Tensor:
        raise NotImplementedError(f"{self._type_name()} does not implement forward(hidden, batch, state=None)")

    def flops(self, batch: Batch) -> tuple[int, int]:
        """(forward, backward) floating-point operations over the whole batch, all ranks together."""
        raise NotImplementedError(
            f"{self._type_name()} does not implement flops(batch) -> (forward, backward): training reports MFU from "
            "it (docs/plugins/write-a-mixer.md, FLOPs)"
        )

    _kind = "layer"

    def _type_name(self) -> str:
        """`mixer type 'name'` (MLP, layer) as configs write it (the class name for a config no plugin registered)."""
        from blockzoo.plugins import get_registry

        name = get_registry(strict=False).type_name_or(type(self.config), type(self).__name__)
        return f"{self._kind} type {name!r}"


class Mixer(Layer):
    """Mixes information across the tokens of each document, never across documents.

    For generation a mixer keeps per-sequence state: `new_state(...)` allocates it, and `forward` with
    a `state` reads what earlier calls stored and appends the batch's tokens (documents = sequences,
    `batch.past_lengths` = tokens already stored for each).
    """

    _kind = "mixer"

    def new_state(self, num_sequences: int, max_length: int, device: torch.device, dtype: torch.dtype) -> Any:
        declared = GENERATION_CACHE in getattr(type(self.config), "capabilities", ())
        raise NotImplementedError(
            f"{self._type_name()} "
            + ("declares generation_cache but " if declared else "")
            + "does not implement new_state(num_sequences, max_length, device, dtype): it cannot generate; implement "
            "it (and forward with a state) and declare generation_cache on its config"
        )

    def forward_slice(self, hidden: torch.Tensor, batch: Batch, previous: Any) -> tuple[torch.Tensor, Any]:
        """The mixer over one slice of longer sequences: (output, carry).

        `batch` is the slice's (`batch.sequence_data` set; `batch.positions` count from the documents' starts).
        `previous`: the carry the preceding slice returned (None for the first slice of a sequence); `carry`: what
        the next slice needs of this one and every one before it (attention: keys and values of the document still
        open, within the window; an SSM: the state and the convolution's last inputs of the document still open).
        Both are differentiable: gradients flow back through them. Under sequence-data parallelism
        (`batch.sequence_data.group` not None) the slices of the group run at the same time on their ranks: the
        mixer exchanges over the group what its slice needs of the earlier ones (attention: all-gather keys and
        values; an SSM: the scan over ranks), `previous` is the carry of the slice before the WHOLE group's (the
        same on every rank; None at the start), and `carry` is the carry after the group's last slice, the same on
        every rank.

        A mixer that implements it declares the `sequence_data_parallel` capability on its config."""
        raise NotImplementedError(
            f"{self._type_name()} does not declare sequence_data_parallel: it cannot run slices of sequences "
            "(distributed.sequence_data_parallel, distributed.micro_sequence_length); implement forward_slice and "
            "declare the capability on its config"
        )


class MLP(Layer):
    """Transforms each token independently."""

    _kind = "MLP"
