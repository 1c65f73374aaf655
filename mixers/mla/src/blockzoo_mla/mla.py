"""Multi-head latent attention (DeepSeek-V2/V3): low-rank query, one compressed key-value latent per token with a
rotary key part shared by every head, attention over packed documents through the attention plugin's kernels.

Per token (see `MLAConfig`):
    query        = query_up(query_norm(query_down(x)))         or query(x)     [heads, nope + rotary]
    latent, k_r  = key_value_down(x)                                           [rank], [rotary]
    k_n, value   = key_value_up(key_value_norm(latent))                        [heads, nope], [heads, value]
    key_h        = [k_n_h ‖ rotate(k_r)],  query_h = [q_n_h ‖ rotate(q_r_h)]
    output       = dense(attention(query, key, value))

Tensor parallelism splits the heads. The down projections and their norms are replicated: under sequence-tensor
parallelism they run on this rank's tokens (their gradients summed over the ranks, as any replicated layer of the
residual stream), and `query_up` / `key_value_up` gather the compressed tokens, cheaper than gathering the hidden
state; the shared rotary key part enters the tensor region by itself.

Generation keeps the latent cache: per token the normalized latent and the rotated shared key part (rank + rotary
numbers, against 2·heads·head size for a KV cache). A prefill or a chunk of several tokens expands the cached latents
to keys and values with `key_value_up`; a step of one token per sequence attends in the absorbed form (DeepSeek-V2,
section 2.1.2): `key_value_up`'s key rows W_k fold into the query (q_n·W_k c = (W_kᵀ q_n)·c) and its value rows W_v
into the output (Σ p W_v c = W_v Σ p c), so the attention runs over the cached latents themselves. The biases of
`key_value_up`, if any, fold too: the key bias adds one constant to a query's logits (softmax ignores it), the value
bias is added once (the probabilities sum to 1).

Slices of sequences (`forward_slice`: sequence-data parallelism, micro-sequences) reuse attention's scheme (see
`blockzoo_attention.attention`) on what MLA caches: each slice's compressed tokens, the normalized latent ‖ the rotated
shared key part (rank + rotary numbers a token, against 2·heads·head size of keys and values), are all-gathered over
the sequence-data group (`gather_slices`: its backward returns each rank's gradients to it) and carried to the next
micro-sequence as the blocks they were gathered in. Each rank expands with `key_value_up` only the stretch its queries
see (the continued document's tokens before the slice, then the slice) into its heads' keys and values, causal and
document-masked by global positions. With a carry, that expansion and the attention are recomputed in the backward
pass, so the memory kept is the latents', linear in the tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from blockzoo.api import (
    Batch,
    CompositeTensorDim,
    Distributed,
    Linear,
    Mixer,
    NormalInitializationConfig,
    NormalizationConfig,
    TensorDim,
    copy_to_tensor_region,
    gather_slices,
    gather_tokens,
    get_registry,
    linear_options,
    scaled_lr,
)
from blockzoo_attention.caches import check_cache_length, check_cached_batch
from blockzoo_attention.kernels import Segments, select_kernel
from blockzoo_attention.rotary import apply_rotary, rotary_constants, rotary_tables
from blockzoo_attention.slices import slice_keys, stretch
from blockzoo_mla.config import MLAConfig


def _one_head_size(kernel: str, prepared) -> bool:
    """Whether the kernel needs values of the query/key head size: flash's varlen and FlexAttention do; SDPA (the
    `torch` kernel, and `batched` over documents of one length) takes any value head size."""
    if kernel == "torch":
        return False
    return not (kernel == "batched" and isinstance(prepared, dict) and "documents" in prepared)


class LatentCache:
    """The latent KV cache for generation: `latent` `[sequences, max_length, key_value_rank]` (after
    `key_value_norm`) and `rotary_key` `[sequences, max_length, rotary_head_size]` (after rotary). Replicated over
    tensor-parallel ranks: every head reads every latent. Inference only: what is stored is detached."""

    def __init__(self, latent: torch.Tensor, rotary_key: torch.Tensor):
        self.latent = latent
        self.rotary_key = rotary_key

    def store(self, latent: torch.Tensor, rotary_key: torch.Tensor, batch: Batch) -> int:
        """Store the batch's tokens after each sequence's past; return how many positions are filled (the longest
        sequence's)."""
        check_cached_batch(batch, self.latent, "multi-head latent attention")
        stored = batch.preprocessed("blockzoo_mla.stored_length", lambda: int(batch.positions.max()) + 1)
        check_cache_length(stored, self.latent)
        self.latent[batch.document_index, batch.positions] = latent.detach().to(self.latent.dtype)
        self.rotary_key[batch.document_index, batch.positions] = rotary_key.detach().to(self.rotary_key.dtype)
        return stored


class LatentCarry(NamedTuple):
    """What the slices after a step need of the tokens before them: their compressed tokens `[tokens, key_value_rank
    + rotary_head_size]` (the normalized latent ‖ the rotated shared key part), as the blocks they were gathered in
    (the same on every sequence-data and tensor-parallel rank)."""

    blocks: tuple[torch.Tensor, ...]

    @property
    def tokens(self) -> int:
        return sum(len(block) for block in self.blocks)


class MultiHeadLatentAttention(Mixer):
    def __init__(
        self, config: MLAConfig, *, name: str, hidden_dim: TensorDim, distributed: Distributed, lr_scale: float
    ):
        lr_scale = scaled_lr(lr_scale, config.lr_scale)
        super().__init__(config, name=name, hidden_dim=hidden_dim, distributed=distributed, lr_scale=lr_scale)
        if config.heads % distributed.tensor_size:
            raise ValueError(
                f"multi-head latent attention {name!r}: tensor_parallel={distributed.tensor_size} must divide heads "
                f"({config.heads})"
            )
        heads = TensorDim("heads", config.heads, parallel=True)
        self._local_heads = heads.local_size(distributed.tensor_size)
        query_dim = CompositeTensorDim("query", (heads, TensorDim("query_head", config.query_key_head_size)))
        key_value_dim = CompositeTensorDim(
            "key_value", (heads, TensorDim("key_value_head", config.nope_head_size + config.value_head_size))
        )
        value_dim = CompositeTensorDim("value", (heads, TensorDim("value_head", config.value_head_size)))
        latent_dim = TensorDim("latent", config.key_value_rank + config.rotary_head_size)
        self._latent_norm_dim = TensorDim("key_value_rank", config.key_value_rank)
        linear = linear_options(config, distributed, lr_scale, std=hidden_dim.global_size**-0.5)
        # PEFT defaults (LoRA's usual targets, as attention's query and value): the query and the dense projections.
        if config.query_rank is None:
            self.query = Linear(f"{name}.query", config.query, hidden_dim, query_dim, default_peft=True, **linear)
            self.query_down = self.query_norm = self.query_up = None
        else:
            self.query = None
            rank_dim = TensorDim("query_rank", config.query_rank)
            down = {**linear, "default_initialization": NormalInitializationConfig(std=hidden_dim.global_size**-0.5)}
            self.query_down = Linear(f"{name}.query_down", config.query_down, hidden_dim, rank_dim, **down)
            self.query_norm = self._norm(config.query_norm, "query_norm", rank_dim, lr_scale)
            up = {**linear, "default_initialization": NormalInitializationConfig(std=config.query_rank**-0.5)}
            self.query_up = Linear(f"{name}.query_up", config.query_up, rank_dim, query_dim, default_peft=True, **up)
        self.key_value_down = Linear(f"{name}.key_value_down", config.key_value_down, hidden_dim, latent_dim, **linear)
        self.key_value_norm = self._norm(config.key_value_norm, "key_value_norm", self._latent_norm_dim, lr_scale)
        up = {**linear, "default_initialization": NormalInitializationConfig(std=config.key_value_rank**-0.5)}
        self.key_value_up = Linear(
            f"{name}.key_value_up", config.key_value_up, self._latent_norm_dim, key_value_dim, **up
        )
        self.dense = Linear(f"{name}.dense", config.dense, value_dim, hidden_dim, default_peft=True, **linear)
        # Looked up here, never in the forward (which torch.compile traces: see blockzoo_attention.rotary.Rotary).
        self._rotary = rotary_constants(config.rotary, config.rotary_head_size)

    def _norm(self, config: NormalizationConfig, role: str, dim: TensorDim, lr_scale: float) -> nn.Module:
        implementation = get_registry().implementation_of(config)
        if implementation is None:
            return nn.Identity()
        return implementation(
            config, name=f"{self.name}.{role}", hidden_dim=dim, distributed=self.distributed, lr_scale=lr_scale
        )

    # -- projections -------------------------------------------------------------------------------------------------

    def _queries(self, hidden: torch.Tensor, tables) -> tuple[torch.Tensor, torch.Tensor]:
        """(nope part, rotated part) of this rank's query heads, `[tokens, heads, nope]`, `[tokens, heads, rotary]`."""
        if self.query is not None:
            query = self.query(hidden)
        else:
            query = self.query_up(self.query_norm(self.query_down(hidden)))
        query = query.unflatten(-1, (self._local_heads, self.config.query_key_head_size))
        nope, rotary = query.split([self.config.nope_head_size, self.config.rotary_head_size], dim=-1)
        return nope, self._rotate(rotary, tables)

    def _latents(self, hidden: torch.Tensor, tables) -> tuple[torch.Tensor, torch.Tensor]:
        """The normalized latent (this rank's tokens under sequence-tensor parallelism) and the rotated shared key
        part of every token, `[tokens, rotary]`, inside the tensor region."""
        latent, rotary_key = self.key_value_down(hidden).split(
            [self.config.key_value_rank, self.config.rotary_head_size], dim=-1
        )
        enter = gather_tokens if self.distributed.sequence_tensor_parallel else copy_to_tensor_region
        rotary_key = enter(rotary_key, self.distributed.tensor_group)
        return self.key_value_norm(latent), self._rotate(rotary_key[:, None], tables)[:, 0]

    def _rotate(self, rotary: torch.Tensor, tables) -> torch.Tensor:
        """Rotary on `[tokens, heads, rotary]`. Interleaved pairs (2i, 2i+1) are first gathered into the rotate-half
        layout (i, i + size/2), as transformers does: queries and keys alike, so the logits are those of the
        interleaved rotation, and the cache holds rotated keys in that layout."""
        if tables is None:
            return rotary
        if self.config.interleaved_rotary:
            rotary = torch.cat([rotary[..., 0::2], rotary[..., 1::2]], dim=-1)
        return apply_rotary(rotary, tables)

    def _keys_values(
        self, latent: torch.Tensor, rotary_key: torch.Tensor, replicated: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head's key `[tokens, heads, nope + rotary]` and value `[tokens, heads, value]` from the latents (this
        rank's tokens under sequence-tensor parallelism, or every token, the same on every rank, if `replicated`)."""
        expanded = self._expand_replicated(latent) if replicated else self.key_value_up(latent)
        expanded = expanded.unflatten(-1, (self._local_heads, self.config.nope_head_size + self.config.value_head_size))
        key_nope, value = expanded.split([self.config.nope_head_size, self.config.value_head_size], dim=-1)
        key = torch.cat([key_nope, rotary_key[:, None, :].expand(-1, self._local_heads, -1)], dim=-1)
        return key, value

    def _expand_replicated(self, latent: torch.Tensor) -> torch.Tensor:
        """`key_value_up` of latents that every tensor-parallel rank holds alike. Under sequence-tensor parallelism
        `key_value_up` gathers its input's tokens over the tensor group: each rank gives it its share of the rows
        (padded to a multiple of the ranks), so the gather's backward sums every rank's gradient of a row into the
        share of the rank that gave it, which the gather of the latents (`forward_slice`) returns to the token's
        owner."""
        if not self.distributed.sequence_tensor_parallel:
            return self.key_value_up(latent)
        ranks, rows = self.distributed.tensor_size, len(latent)
        share = -(-rows // ranks)
        padded = F.pad(latent, (0, 0, 0, share * ranks - rows))
        rank = self.distributed.tensor_rank
        return self.key_value_up(padded[rank * share : (rank + 1) * share])[:rows]

    # -- forward -----------------------------------------------------------------------------------------------------

    def forward(self, hidden: torch.Tensor, batch: Batch, state: LatentCache | None = None) -> torch.Tensor:
        tables = rotary_tables(self._rotary, batch)
        query_nope, query_rotary = self._queries(hidden, tables)
        latent, rotary_key = self._latents(hidden, tables)
        queries = keys = Segments.of(batch)
        if state is not None:
            if self.distributed.sequence_tensor_parallel:
                raise ValueError(
                    f"multi-head latent attention {self.name!r}: generation with sequence_tensor_parallel is not "
                    "supported (the latent cache holds every token)"
                )
            stored = state.store(latent, rotary_key, batch)
            if batch.max_length == 1 and self._absorbable():
                output = self._absorbed_decode(query_nope, query_rotary, state, batch, stored)
                return self.dense(output.flatten(1))
            keys = batch.preprocessed(
                "blockzoo_mla.cached_keys", lambda: Segments.from_lengths(batch.past_lengths + batch.lengths)
            )
            read = (keys.document_index, keys.positions)
            latent, rotary_key = state.latent[read].to(hidden.dtype), state.rotary_key[read].to(hidden.dtype)
        key, value = self._keys_values(latent, rotary_key)
        query = torch.cat([query_nope, query_rotary], dim=-1)
        implementation = self.config.implementation
        if state is not None and implementation == "flex":
            implementation = "auto"  # Every decoding step has new shapes, and each would recompile FlexAttention.
        kernel = select_kernel(implementation, query)
        prepared = batch.preprocessed(
            ("blockzoo_mla.kernel", kernel.name, state is not None),
            lambda: kernel.prepare(queries, keys, True, None),
        )
        return self.dense(self._attend(kernel, prepared, query, key, value).flatten(1))

    def _attend(self, kernel, prepared, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """The kernel's attention `[tokens, heads, value]`, the heads padded to one size where the kernel needs it."""
        value_size, query_size = self.config.value_head_size, self.config.query_key_head_size
        if value_size != query_size and _one_head_size(kernel.name, prepared):
            # Zero value channels give zero output channels, cut off below; zero query/key channels add nothing.
            if value_size < query_size:
                value = F.pad(value, (0, query_size - value_size))
            else:
                query, key = (F.pad(tensor, (0, value_size - query_size)) for tensor in (query, key))
        output = kernel.attend(query, key, value, prepared, self.config.resolved_softmax_scale)
        return output[..., :value_size]

    def forward_slice(
        self, hidden: torch.Tensor, batch: Batch, previous: LatentCarry | None
    ) -> tuple[torch.Tensor, LatentCarry]:
        """Attention over one slice of longer sequences (see the module and `blockzoo.api.Mixer.forward_slice`)."""
        tables = rotary_tables(self._rotary, batch)
        query_nope, query_rotary = self._queries(hidden, tables)
        latent, rotary_key = self._latents(hidden, tables)
        if self.distributed.sequence_tensor_parallel:  # every token's latent, as the rotary key part already is
            latent = gather_tokens(latent, self.distributed.tensor_group)
        # One tensor (a new one, not a view: the next slices read it), one gather.
        compressed = gather_slices(torch.cat([latent, rotary_key], dim=-1), batch.sequence_data.group)
        blocks = (compressed,) if previous is None else (*previous.blocks, compressed)
        # The stream of tokens: the carried ones, then the group's slices in rank order; this slice's place in it.
        start = (0 if previous is None else previous.tokens) + batch.sequence_data.rank * batch.num_tokens
        seen = batch.continued
        if seen > start:
            raise ValueError(
                f"multi-head latent attention {self.name!r}: the slice continues a document begun {seen} tokens "
                f"before it, but only {start} come before it (the previous slice's carry is missing or cut short)"
            )
        query = torch.cat([query_nope, query_rotary], dim=-1)
        kernel = select_kernel(self.config.implementation, query)
        prepared = batch.preprocessed(
            ("blockzoo_mla.slice_kernel", kernel.name, seen),
            lambda: kernel.prepare(Segments.of(batch), slice_keys(batch, seen), True, None),
        )
        stop = start + len(query)

        def attend(query: torch.Tensor, *blocks: torch.Tensor) -> torch.Tensor:
            # Only the stretch this slice's queries see is expanded to keys and values.
            latent, rotary_key = stretch(blocks, start - seen, stop).split(
                [self.config.key_value_rank, self.config.rotary_head_size], dim=-1
            )
            return self._attend(kernel, prepared, query, *self._keys_values(latent, rotary_key, replicated=True))

        if len(blocks) > 1 and torch.is_grad_enabled():  # keep the latent blocks, not the expanded stretch
            output = checkpoint(attend, query, *blocks, use_reentrant=False)
        else:
            output = attend(query, *blocks)
        return self.dense(output.flatten(1)), LatentCarry(blocks)

    def _absorbable(self) -> bool:
        # An unmerged adapter on key_value_up adds to its output: the weight alone is not the map to fold.
        adapter = self.key_value_up.adapter
        return self.config.absorbed_decoding and (adapter is None or adapter.merged)

    def _absorbed_decode(
        self, query_nope: torch.Tensor, query_rotary: torch.Tensor, state: LatentCache, batch: Batch, stored: int
    ) -> torch.Tensor:
        """One token per sequence: attention over the cached latents in the absorbed form (module doc). Returns
        `[sequences, heads, value]`; logits and softmax in fp32."""
        nope, value_size = self.config.nope_head_size, self.config.value_head_size
        weight = self.key_value_up.weight.float().unflatten(0, (self._local_heads, nope + value_size))
        key_weight, value_weight = weight[:, :nope], weight[:, nope:]  # [heads, nope|value, rank]
        latents = state.latent[:, :stored].float()  # [sequences, stored, rank]
        rotary_keys = state.rotary_key[:, :stored].float()
        absorbed_query = torch.einsum("shn,hnr->shr", query_nope.float(), key_weight)
        logits = torch.einsum("shr,slr->shl", absorbed_query, latents)
        logits = logits + torch.einsum("shp,slp->shl", query_rotary.float(), rotary_keys)
        logits = logits * self.config.resolved_softmax_scale
        future = torch.arange(stored, device=logits.device)[None, :] > batch.positions[:, None]
        probabilities = torch.softmax(logits.masked_fill(future[:, None, :], float("-inf")), dim=-1)
        output = torch.einsum("hvr,shr->shv", value_weight, torch.einsum("shl,slr->shr", probabilities, latents))
        if self.key_value_up.bias is not None:
            output = output + self.key_value_up.bias.float().unflatten(0, (self._local_heads, -1))[:, nope:]
        return output.to(query_nope.dtype)

    def new_state(self, num_sequences: int, max_length: int, device: torch.device, dtype: torch.dtype) -> LatentCache:
        return LatentCache(
            torch.zeros(num_sequences, max_length, self.config.key_value_rank, device=device, dtype=dtype),
            torch.zeros(num_sequences, max_length, self.config.rotary_head_size, device=device, dtype=dtype),
        )

    def flops(self, batch: Batch) -> tuple[int, int]:
        linears = [self.key_value_down, self.key_value_up, self.dense]
        linears += [self.query] if self.query is not None else [self.query_down, self.query_up]
        forward = sum(linear.forward_flops(batch.num_tokens) for linear in linears)
        backward = sum(linear.backward_flops(batch.num_tokens) for linear in linears)
        # Per head and attended (query, key) pair: q·k over nope + rotary channels, p·v over the value channels.
        pairs = int((batch.positions + 1).sum())  # Causal; positions count the cached tokens when generating.
        attention = 2 * self.config.heads * (self.config.query_key_head_size + self.config.value_head_size) * pairs
        return forward + attention, backward + 2 * attention
