"""The contract between the engine and the layers plugins provide (DESIGN.md "The mixer contract").

Packed sequences are the only layout: a micro-batch is documents concatenated along one token
dimension, hidden states are `[tokens, hidden]`, and `Batch` carries the document boundaries. Under
sequence-tensor-parallel the hidden states a layer receives and returns are this rank's contiguous
slice of the tokens, while `Batch` always describes all of them.

A mixer or MLP plugin registers a config class and an implementation class deriving from `Mixer` or
`MLP`; the engine builds it with `(config, name=..., hidden_dim=..., distributed=..., lr_scale=...)`.
What a layer can do (tensor parallel, ...) is declared on its config class (`capabilities`), so a run
it cannot do is refused before anything is built.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import nn

from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.dims import TensorDim

IGNORE_INDEX = -100  # The label of a token with no target (its next token is in another document, or absent).


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host `tensor` on `device`; on a GPU copied from pinned memory without waiting for the device."""
    if device.type == "cpu":
        return tensor
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


class Batch:
    """The documents of one packed micro-batch, and what layers compute from them once.

    `lengths`: tokens of each document, in order. `past_lengths`: for generation, the tokens each
    document (sequence) already has in the layers' caches; positions continue from there.
    """

    def __init__(
        self,
        lengths: Sequence[int] | torch.Tensor,
        *,
        device: torch.device | str = "cpu",
        past_lengths: Sequence[int] | torch.Tensor | None = None,
    ):
        # Everything is computed on the host from the lengths (a tensor on a device is read back once), then moved:
        # on a GPU, from pinned memory without waiting, so making a batch never stalls the device queue.
        self.device = torch.device(device)
        lengths_on_host = torch.as_tensor(lengths, dtype=torch.int64).cpu()
        as_list = lengths_on_host.tolist()
        if lengths_on_host.ndim != 1 or not as_list or min(as_list) <= 0:
            raise ValueError(f"document lengths must be a non-empty list of positive integers, got {lengths}")
        self.num_tokens = sum(as_list)
        self.max_length = max(as_list)
        cu_seqlens = torch.nn.functional.pad(lengths_on_host.cumsum(0), (1, 0)).to(torch.int32)
        document_index = torch.repeat_interleave(torch.arange(len(lengths_on_host)), lengths_on_host)
        # Position of each token in its document (plus what the cache holds, when generating).
        positions = torch.arange(self.num_tokens) - cu_seqlens[:-1].to(torch.int64)[document_index]
        past = None if past_lengths is None else torch.as_tensor(past_lengths, dtype=torch.int64).cpu()
        if past is not None:
            positions = positions + past[document_index]
        self.lengths = to_device(lengths_on_host, self.device)
        self.past_lengths = None if past is None else to_device(past, self.device)
        self.cu_seqlens = to_device(cu_seqlens, self.device)
        self.document_index = to_device(document_index, self.device)
        self.positions = to_device(positions, self.device)
        # Losses layers add during the forward pass (MoE auxiliary losses...), named per layer.
        self.losses: dict[str, torch.Tensor] = {}
        self._preprocessed: dict[Hashable, Any] = {}

    @classmethod
    def from_documents(cls, documents: Sequence[torch.Tensor], **kwargs: Any) -> tuple[torch.Tensor, Batch]:
        """Concatenate token tensors into one packed tensor and its batch."""
        return torch.cat(list(documents)), cls([len(d) for d in documents], **kwargs)

    @property
    def num_documents(self) -> int:
        return len(self.lengths)

    def preprocessed(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        """What `compute` returns, computed once per batch for each distinct `key`.

        Layers key their precomputed tensors (rotary tables, masks) by everything they depend on, so two
        blocks with different settings never share or overwrite an entry, and equal ones compute it once.
        """
        if key not in self._preprocessed:
            self._preprocessed[key] = compute()
        return self._preprocessed[key]

    def add_loss(self, name: str, value: torch.Tensor) -> None:
        """A loss (already weighted by its coefficient) added to the training objective and logged by `name`."""
        if name in self.losses:
            raise ValueError(f"two layers add a loss named {name!r}")
        self.losses[name] = value


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
        raise NotImplementedError

    def flops(self, batch: Batch) -> tuple[int, int]:
        """(forward, backward) floating-point operations over the whole batch, all ranks together."""
        raise NotImplementedError


class Mixer(Layer):
    """Mixes information across the tokens of each document, never across documents.

    For generation a mixer keeps per-sequence state: `new_state(...)` allocates it, and `forward` with
    a `state` reads what earlier calls stored and appends the batch's tokens (documents = sequences,
    `batch.past_lengths` = tokens already stored for each).
    """

    def new_state(self, num_sequences: int, max_length: int, device: torch.device, dtype: torch.dtype) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not support generation")


class MLP(Layer):
    """Transforms each token independently."""
