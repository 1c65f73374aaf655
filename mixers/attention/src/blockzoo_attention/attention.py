"""The attention mixer: query and key‖value projections, per-head norms, rotary embeddings, attention over
packed documents (see `kernels.py`), and the output projection.

Tensor-parallel layout (heads are laid out group-major, so query head h uses key/value group
h // heads_per_group):
- tensor_parallel divides head_groups: the groups are split; query and key‖value are column-parallel.
- otherwise (MQA, or fewer groups than ranks) the heads of each group are split, and key‖value is a
  replicated linear inside the tensor region: every rank computes all groups, its gradient summed over ranks.
The output projection is row-parallel. Under sequence-tensor-parallel the projections gather the token
shards and scatter the output, so attention itself always sees every token.

Slices of sequences (`forward_slice`: sequence-data parallelism, micro-sequences). The slice's keys and values are
all-gathered over the sequence-data group (`gather_slices`, whose backward reduce-scatters each rank's key and value
gradients back to it: Llama 3's all-gather context parallelism, chosen over ring attention because GQA makes keys and
values small and a causal ring leaves ranks idle; a measurement on GPUs is to come). Each query sees the tokens of
its document before it (within the window): the document of a slice's first piece began `batch.continued` tokens
before the slice, every other piece's in the slice, so the keys a slice needs are one contiguous stretch of the
token stream (the carry, then the group's slices), and the masks are exact without knowing where documents end.
The carry is that stream's keys and values as the blocks they were made in (each step's gathered tensors, never
copied), all of them or, with a window, those of its last window − 1 tokens; a query reads from it only what its
document holds. With a carry the attention over the concatenated stretch is recomputed in the backward pass, so the
concatenation (a copy) is never kept: the memory stays that of the blocks, linear in the tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import attrs
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from blockzoo.api import (
    Batch,
    CompositeTensorDim,
    ConcatenatedTensorDim,
    Distributed,
    Linear,
    Mixer,
    NormalizationConfig,
    TensorDim,
    gather_slices,
    get_registry,
    linear_options,
    scaled_lr,
)
from blockzoo_attention.caches import check_cache_length, check_cached_batch
from blockzoo_attention.config import AttentionConfig
from blockzoo_attention.kernels import Segments, select_kernel
from blockzoo_attention.rotary import apply_rotary, rotary_constants, rotary_tables
from blockzoo_attention.slices import last_rows, slice_keys, stretch


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
        check_cached_batch(batch, self.key, "attention")
        lengths = batch.past_lengths + batch.lengths
        check_cache_length(int(lengths.max()), self.key)
        self.key[batch.document_index, batch.positions] = key.detach().to(self.key.dtype)
        self.value[batch.document_index, batch.positions] = value.detach().to(self.value.dtype)
        keys = batch.preprocessed("blockzoo_attention.cached_keys", lambda: Segments.from_lengths(lengths))
        stored = (keys.document_index, keys.positions)
        return self.key[stored].to(key.dtype), self.value[stored].to(value.dtype), keys

    def decode(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        batch: Batch,
        window: int | None,
        scale: float,
    ) -> torch.Tensor:
        """One new token per sequence (a decoding step): store its key and value, and attend with its query
        `[sequences, heads, head_size]` to its sequence's stored keys read in place, `[sequences, heads, stored,
        head_size]` views of the cache (no gather of every stored key into a packed copy, as `append` makes)."""
        check_cached_batch(batch, self.key, "attention")
        stored = batch.preprocessed("blockzoo_attention.decoded_length", lambda: int(batch.positions.max()) + 1)
        check_cache_length(stored, self.key)
        self.key[batch.document_index, batch.positions] = key.detach().to(self.key.dtype)
        self.value[batch.document_index, batch.positions] = value.detach().to(self.value.dtype)
        keys, values = (cache[:, :stored].transpose(1, 2).to(query.dtype) for cache in (self.key, self.value))
        mask = batch.preprocessed(
            ("blockzoo_attention.decoding_mask", window, stored), lambda: _decoding_mask(batch, window, stored)
        )
        groups = query.shape[1] // keys.shape[1]
        if groups > 1:  # each key head serves consecutive query heads
            keys, values = (tensor.repeat_interleave(groups, dim=1) for tensor in (keys, values))
        output = F.scaled_dot_product_attention(query.unsqueeze(2), keys, values, attn_mask=mask, scale=scale)
        return output.squeeze(2)


def _decoding_mask(batch: Batch, window: int | None, stored: int) -> torch.Tensor | None:
    """`[sequences, 1, 1, stored]`: which stored keys each sequence's new token sees (its own sequence's, within the
    window); None when it sees them all."""
    if batch.num_documents == 1 and (window is None or stored <= window):
        return None
    columns = torch.arange(stored, device=batch.device)
    position = batch.positions[:, None]
    seen = columns <= position
    if window is not None:
        seen &= columns > position - window
    return seen[:, None, None, :]


class AttentionCarry(NamedTuple):
    """What the slices after a step need of the tokens before them: their keys and values (after norms and rotary)
    `[tokens, key_heads, head_size]`, as the blocks they were made in (the same on every sequence-data rank)."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    @property
    def tokens(self) -> int:
        return sum(len(block) for block in self.keys)


class Attention(Mixer):
    def __init__(
        self, config: AttentionConfig, *, name: str, hidden_dim: TensorDim, distributed: Distributed, lr_scale: float
    ):
        lr_scale = scaled_lr(lr_scale, config.lr_scale)
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

        linear = linear_options(config, distributed, lr_scale, std=hidden_dim.global_size**-0.5)
        # PEFT defaults (LoRA's usual targets): query and value adapted, key and dense not.
        self.query = Linear(f"{name}.query", config.query, hidden_dim, heads_dim, default_peft=True, **linear)
        self.key_value = Linear(
            f"{name}.key_value",
            (config.key, config.value),
            hidden_dim,
            key_value_dim,
            default_peft=(False, True),
            inside_tensor_region=not key_value_dim.parallel,
            **linear,
        )
        self.dense = Linear(f"{name}.dense", config.dense, heads_dim, hidden_dim, **linear)
        # Split like the query heads: each rank gates its own heads' outputs.
        self.output_gate = (
            None
            if config.output_gate is None
            else Linear(f"{name}.output_gate", config.output_gate, hidden_dim, heads_dim, **linear)
        )
        self.query_norm = self._head_norm(config.query_norm, "query_norm", lr_scale)
        self.key_norm = self._head_norm(config.key_norm, "key_norm", lr_scale)
        self._rotary = rotary_constants(config.rotary, config.head_size)  # looked up here, never in the forward

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

    def _project(self, hidden: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """query, key and value `[tokens, heads, head_size]` of every token of the batch (this rank's heads), after
        the per-head norms and rotary."""
        head_size = self.config.head_size
        query = self.query(hidden).unflatten(-1, (-1, head_size))
        key_value = self.key_value(hidden)
        key, value = (key_value[:, rows].unflatten(-1, (-1, head_size)) for rows in self._key_value_slices)
        if self.config.key_multiplier != 1:
            key = key * self.config.key_multiplier
        if self.query_norm is not None:
            query = self.query_norm(query)
        if self.key_norm is not None:
            key = self.key_norm(key)
        if (tables := rotary_tables(self._rotary, batch)) is not None:
            query, key = apply_rotary(query, tables), apply_rotary(key, tables)
        return query, key, value

    def _output(self, output: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """dense of the heads' outputs `[tokens, heads, head_size]`, gated first when there is an output gate."""
        output = output.flatten(1)
        if self.output_gate is not None:
            output = output * torch.sigmoid(self.output_gate(hidden))
        return self.dense(output)

    def forward(self, hidden: torch.Tensor, batch: Batch, state: KeyValueCache | None = None) -> torch.Tensor:
        query, key, value = self._project(hidden, batch)
        if state is not None and batch.max_length == 1:
            window, scale = self.config.window_size, self.config.resolved_softmax_scale
            return self._output(state.decode(query, key, value, batch, window, scale), hidden)
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
        return self._output(output, hidden)

    def forward_slice(
        self, hidden: torch.Tensor, batch: Batch, previous: AttentionCarry | None
    ) -> tuple[torch.Tensor, AttentionCarry]:
        """Attention over one slice of longer sequences (see the module and `blockzoo.api.Mixer.forward_slice`)."""
        query, key, value = self._project(hidden, batch)
        # Carried as they are (the next slices read them): a tensor of their own, not a view of the projection's.
        key, value = key.contiguous(), value.contiguous()
        sequence_data = batch.sequence_data
        keys, values = gather_slices(key, sequence_data.group), gather_slices(value, sequence_data.group)
        if previous is not None:
            keys, values = (*previous.keys, keys), (*previous.values, values)
        else:
            keys, values = (keys,), (values,)
        # The stream of tokens: the carried ones, then the group's slices in rank order; this slice's place in it.
        before = 0 if previous is None else previous.tokens
        start = before + sequence_data.rank * len(query)
        window = self.config.window_size
        seen = batch.continued if window is None else min(batch.continued, window - 1)
        if seen > start:
            raise ValueError(
                f"attention {self.name!r}: the slice continues a document begun {batch.continued} tokens before it, "
                f"but only {start} come before it (the previous slice's carry is missing or cut short)"
            )
        kernel = select_kernel(self.config.implementation, query)
        causal = self.config.causal
        prepared = batch.preprocessed(
            ("blockzoo_attention.slice_kernel", kernel.name, causal, window, seen),
            lambda: kernel.prepare(Segments.of(batch), slice_keys(batch, seen), causal, window),
        )
        scale, stop = self.config.resolved_softmax_scale, start + len(query)

        def attend(query: torch.Tensor, *blocks: torch.Tensor) -> torch.Tensor:
            key_blocks, value_blocks = blocks[: len(blocks) // 2], blocks[len(blocks) // 2 :]
            keys_values = (stretch(key_blocks, start - seen, stop), stretch(value_blocks, start - seen, stop))
            return kernel.attend(query, *keys_values, prepared, scale)

        if len(keys) > 1 and torch.is_grad_enabled():  # keep the blocks, not their concatenation
            output = checkpoint(attend, query, *keys, *values, use_reentrant=False)
        else:
            output = attend(query, *keys, *values)
        carry = AttentionCarry(keys, values)
        if window is not None:
            carry = AttentionCarry(last_rows(keys, window - 1), last_rows(values, window - 1))
        return self._output(output, hidden), carry

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
        linears = (self.query, self.key_value, self.dense, *([] if self.output_gate is None else [self.output_gate]))
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
