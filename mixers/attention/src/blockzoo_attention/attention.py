"""The attention mixer: query and key‖value projections, per-head norms, rotary embeddings, attention over
packed documents (see `kernels.py`), and the output projection.

Tensor-parallel layout (heads are laid out group-major, so query head h uses key/value group
h // heads_per_group):
- tensor_parallel divides head_groups: the groups are split; query and key‖value are column-parallel.
- otherwise (MQA, or fewer groups than ranks) the heads of each group are split, and key‖value is a
  replicated linear inside the tensor region: every rank computes all groups, its gradient summed over ranks.
The output projection is row-parallel. Under sequence-tensor-parallel the projections gather the token
shards and scatter the output, so attention itself always sees every token.
"""

from __future__ import annotations

import attrs
import torch
from torch import nn

from blockzoo.api import (
    Batch,
    CompositeTensorDim,
    ConcatenatedTensorDim,
    Distributed,
    Linear,
    Mixer,
    NormalInitializationConfig,
    NormalizationConfig,
    TensorDim,
    get_registry,
)
from blockzoo_attention.config import AttentionConfig
from blockzoo_attention.kernels import Segments, select_kernel
from blockzoo_attention.rotary import apply_rotary, rotary_tables


class KeyValueCache:
    """Keys and values of each sequence for generation, `[sequences, max_length, key_heads, head_size]`.

    Inference only: what is stored is detached from the autograd graph.
    """

    def __init__(self, key: torch.Tensor, value: torch.Tensor):
        self.key = key
        self.value = value

    def append(
        self, key: torch.Tensor, value: torch.Tensor, batch: Batch
    ) -> tuple[torch.Tensor, torch.Tensor, Segments]:
        """Store the batch's keys and values after each sequence's past; return every stored key and value so far."""
        if batch.past_lengths is None:
            raise ValueError("attention with a generation cache needs `batch.past_lengths`")
        sequences, max_length = self.key.shape[:2]
        if batch.num_documents != sequences:
            raise ValueError(f"the batch has {batch.num_documents} sequences but the cache holds {sequences}")
        lengths = batch.past_lengths + batch.lengths
        if int(lengths.max()) > max_length:
            raise ValueError(f"sequences of up to {int(lengths.max())} tokens exceed the cache's {max_length}")
        self.key[batch.document_index, batch.positions] = key.detach().to(self.key.dtype)
        self.value[batch.document_index, batch.positions] = value.detach().to(self.value.dtype)
        keys = batch.preprocessed("blockzoo_attention.cached_keys", lambda: Segments.from_lengths(lengths))
        stored = (keys.document_index, keys.positions)
        return self.key[stored].to(key.dtype), self.value[stored].to(value.dtype), keys


class Attention(Mixer):
    def __init__(
        self, config: AttentionConfig, *, name: str, hidden_dim: TensorDim, distributed: Distributed, lr_scale: float
    ):
        lr_scale *= 1.0 if config.lr_scale is None else config.lr_scale
        super().__init__(config, name=name, hidden_dim=hidden_dim, distributed=distributed, lr_scale=lr_scale)
        tensor_size = distributed.tensor_size
        groups = config.resolved_head_groups
        heads_per_group = config.heads // groups
        split_groups = groups % tensor_size == 0
        if not split_groups and heads_per_group % tensor_size:
            raise ValueError(
                f"attention {name!r}: tensor_parallel={tensor_size} must divide head_groups ({groups}) "
                f"or the heads of each group ({heads_per_group})"
            )
        group_dim = TensorDim("head_groups", groups, parallel=split_groups)
        group_heads_dim = TensorDim("group_heads", heads_per_group, parallel=not split_groups)
        self._head_size_dim = TensorDim("head_size", config.head_size)
        heads_dim = CompositeTensorDim("heads", (group_dim, group_heads_dim, self._head_size_dim))
        key_value_dim = ConcatenatedTensorDim(
            "key_value",
            (
                CompositeTensorDim("key", (group_dim, self._head_size_dim)),
                CompositeTensorDim("value", (group_dim, self._head_size_dim)),
            ),
        )
        self._key_value_slices = key_value_dim.component_slices(tensor_size)

        linear = {
            "distributed": distributed,
            "default_initialization": NormalInitializationConfig(std=hidden_dim.global_size**-0.5),
            "default_bias": config.add_linear_biases,
            "lr_scale": lr_scale,
        }
        self.query = Linear(f"{name}.query", config.query, hidden_dim, heads_dim, **linear)
        self.key_value = Linear(
            f"{name}.key_value",
            (config.key, config.value),
            hidden_dim,
            key_value_dim,
            inside_tensor_region=not key_value_dim.parallel,
            **linear,
        )
        self.dense = Linear(f"{name}.dense", config.dense, heads_dim, hidden_dim, **linear)
        self.query_norm = self._head_norm(config.query_norm, "query_norm", lr_scale)
        self.key_norm = self._head_norm(config.key_norm, "key_norm", lr_scale)

    def _head_norm(self, config: NormalizationConfig | None, role: str, lr_scale: float) -> nn.Module | None:
        implementation = None if config is None else get_registry().implementation_of(config)
        if implementation is None:
            return None
        norm = implementation(
            config,
            name=f"{self.name}.{role}",
            hidden_dim=self._head_size_dim,
            distributed=self.distributed,
            lr_scale=lr_scale,
        )
        # Inside the tensor region each rank normalizes only its heads (of all tokens): partial gradients.
        for parameter in norm.parameters():
            parameter.meta = attrs.evolve(
                parameter.meta, reduce_gradient_over_tensor_group=self.distributed.tensor_size > 1
            )
        return norm

    def forward(self, hidden: torch.Tensor, batch: Batch, state: KeyValueCache | None = None) -> torch.Tensor:
        head_size = self.config.head_size
        query = self.query(hidden).unflatten(-1, (-1, head_size))
        key_value = self.key_value(hidden)
        key, value = (key_value[:, rows].unflatten(-1, (-1, head_size)) for rows in self._key_value_slices)
        if self.query_norm is not None:
            query = self.query_norm(query)
        if self.key_norm is not None:
            key = self.key_norm(key)
        if (tables := rotary_tables(self.config.rotary, head_size, batch)) is not None:
            query, key = apply_rotary(query, tables), apply_rotary(key, tables)

        queries = Segments.of(batch)
        if state is None:
            keys = queries
        else:
            key, value, keys = state.append(key, value, batch)
        implementation = self.config.implementation
        if state is not None and implementation == "flex":
            # Every decoding step has new shapes, and each would recompile FlexAttention's kernel.
            implementation = "auto"
        kernel = select_kernel(implementation, query)
        causal, window = self.config.causal, self.config.window_size
        prepared = batch.preprocessed(
            ("blockzoo_attention.kernel", kernel.name, causal, window, state is not None),
            lambda: kernel.prepare(queries, keys, causal, window),
        )
        output = kernel.attend(query, key, value, prepared, self.config.resolved_softmax_scale)
        return self.dense(output.flatten(1))

    def new_state(self, num_sequences: int, max_length: int, device: torch.device, dtype: torch.dtype) -> KeyValueCache:
        if not self.config.causal:
            raise ValueError(f"attention {self.name!r}: generation needs causal attention")
        key_rows = self._key_value_slices[0]
        key_heads = (key_rows.stop - key_rows.start) // self.config.head_size
        shape = (num_sequences, max_length, key_heads, self.config.head_size)
        return KeyValueCache(
            torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype)
        )

    def flops(self, batch: Batch) -> tuple[int, int]:
        linears = (self.query, self.key_value, self.dense)
        forward = sum(linear.forward_flops(batch.num_tokens) for linear in linears)
        backward = sum(linear.backward_flops(batch.num_tokens) for linear in linears)
        # Two matmuls (q·k, p·v) of 2·head_size operations per head and attended (query, key) pair; backward twice.
        attention = 4 * self.config.heads * self.config.head_size * self._attended_pairs(batch)
        return forward + attention, backward + 2 * attention

    def _attended_pairs(self, batch: Batch) -> int:
        if not self.config.causal:
            return int((batch.lengths**2).sum())
        seen = batch.positions + 1  # Positions count the cached tokens when generating.
        if self.config.window_size is not None:
            seen = seen.clamp(max=self.config.window_size)
        return int(seen.sum())
