"""The language model: embeddings → block sequence → head, over packed documents.

Vocabulary-parallel under tensor parallelism: each tensor-parallel rank holds a contiguous slice of the
vocabulary rows of the embedding table and of the output weight (one parameter when tied), the vocabulary
zero-padded to a multiple of the tensor-parallel size (`PaddedTensorDim`; checkpoints hold the true
`[vocab, hidden]`). A lookup embeds the ids of the rank's slice and the partial embeddings are summed over the
tensor group (under sequence-tensor-parallel, reduce-scattered so that each rank keeps its own tokens). The head
computes the loss with the vocabulary-parallel `linear_cross_entropy`, which never materializes the logits of all
tokens (also in a single process); full logits, asked for by `forward` and generation, are gathered.

Under sequence-tensor-parallel the residual stream holds each rank's contiguous slice of the tokens: the replicated
position embeddings and head norm see token shards, and their gradients are summed over the tensor group (see
`create_parameter`'s `token_sharded_input`); the head gathers the tokens, since every rank computes its vocabulary
slice of every token's logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from blockzoo.conversion import Origin
from blockzoo.distributed.ops import gather_tokens, reduce_from_tensor_region, reduce_scatter_tokens
from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.base import Batch, slice_losses
from blockzoo.layers.config import NormalInitializationConfig, scaled_lr
from blockzoo.layers.cross_entropy import linear_cross_entropy
from blockzoo.layers.dims import PaddedTensorDim, TensorDim
from blockzoo.layers.parameter import create_parameter
from blockzoo.model.block import build_part, scaled
from blockzoo.model.config import EmbeddingsConfig, HeadConfig, ModelConfig
from blockzoo.model.generation import GeneratedTokens, check_prompts, next_tokens
from blockzoo.peft.apply import apply_peft


def own_tokens(tensor: torch.Tensor, distributed: Distributed) -> torch.Tensor:
    """This rank's contiguous slice of a per-token tensor under sequence-tensor-parallel (else all of it)."""
    if not distributed.sequence_tensor_parallel:
        return tensor
    size, remainder = divmod(len(tensor), distributed.tensor_size)
    if remainder:
        raise ValueError(
            f"{len(tensor)} tokens cannot be split between {distributed.tensor_size} sequence-tensor-parallel ranks"
        )
    return tensor[distributed.tensor_rank * size : (distributed.tensor_rank + 1) * size]


def vocab_dim(vocab_size: int) -> PaddedTensorDim:
    """The vocabulary dim of the embedding table and output weight: split between tensor-parallel ranks, padded."""
    return PaddedTensorDim("vocab", vocab_size, parallel=True)


def _vocab_slice(distributed: Distributed, vocab_size: int) -> tuple[int, int]:
    """(first id, rows) of this tensor-parallel rank's slice of the vocabulary (the last rows may be padding)."""
    rows = vocab_dim(vocab_size).local_size(distributed.tensor_size)
    return distributed.tensor_rank * rows, rows


class Embeddings(nn.Module):
    def __init__(self, config: EmbeddingsConfig, *, hidden_dim: TensorDim, distributed: Distributed, lr_scale: float):
        super().__init__()
        self.distributed = distributed
        lr_scale = scaled_lr(lr_scale, config.lr_scale)
        initialization = NormalInitializationConfig(std=hidden_dim.global_size**-0.5)
        settings = config.word_embeddings.resolve(initialization=initialization, lr_scale=lr_scale)
        self.vocab_size = config.vocab_size
        self.multiplier = config.multiplier
        self.word_embeddings = create_parameter(
            "embeddings.word_embeddings", (vocab_dim(config.vocab_size), hidden_dim), settings, distributed
        )
        self.position_embeddings = None
        if config.position_embeddings:
            positions_dim = TensorDim("positions", config.num_position_embeddings)
            self.position_embeddings = create_parameter(
                "embeddings.position_embeddings",
                (positions_dim, hidden_dim),
                settings,
                distributed,
                token_sharded_input=True,
            )

    def forward(self, tokens: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The embeddings of this rank's tokens (all of them unless sequence-tensor-parallel), in the compute dtype."""
        distributed = self.distributed
        if distributed.tensor_size == 1:
            hidden = F.embedding(tokens, self.word_embeddings)
        else:
            hidden = self._vocab_parallel_lookup(tokens)
            # Each token's row lives on one rank: the sum over the group is exact, in any order.
            reduce = reduce_scatter_tokens if distributed.sequence_tensor_parallel else reduce_from_tensor_region
            hidden = reduce(hidden, distributed.tensor_group)
        if self.position_embeddings is not None:
            positions = own_tokens(batch.positions, self.distributed)
            if len(positions) and int(positions.max()) >= len(self.position_embeddings):
                raise ValueError(
                    f"position {int(positions.max())} is beyond the {len(self.position_embeddings)} learned positions "
                    "(model.embeddings.num_position_embeddings)"
                )
            hidden = hidden + F.embedding(positions, self.position_embeddings)
        return scaled(hidden, self.multiplier).to(self.distributed.compute_dtype)

    def _vocab_parallel_lookup(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embeddings of the ids in this rank's slice of the vocabulary, zeros for the others (all tokens)."""
        start, rows = _vocab_slice(self.distributed, self.vocab_size)
        local = tokens - start
        elsewhere = (local < 0) | (local >= rows)
        # Masking the output also masks the gradient: row 0, which the ids elsewhere look up, gets none from them.
        hidden = F.embedding(local.masked_fill(elsewhere, 0), self.word_embeddings)
        return hidden.masked_fill(elsewhere.unsqueeze(1), 0.0)


class Head(nn.Module):
    def __init__(
        self,
        config: HeadConfig,
        *,
        hidden_dim: TensorDim,
        vocab_size: int,
        distributed: Distributed,
        lr_scale: float,
        tied_weight: nn.Parameter | None,
    ):
        super().__init__()
        self.distributed = distributed
        self.vocab_size = vocab_size
        self.logits_multiplier = config.logits_multiplier
        lr_scale = scaled_lr(lr_scale, config.lr_scale)
        self.normalization = build_part(
            config.normalization,
            name="head.normalization",
            hidden_dim=hidden_dim,
            distributed=distributed,
            lr_scale=lr_scale,
        )
        if tied_weight is not None:
            self.output_weight = tied_weight
        else:
            initialization = NormalInitializationConfig(std=hidden_dim.global_size**-0.5)
            settings = config.output_weight.resolve(initialization=initialization, lr_scale=lr_scale)
            self.output_weight = create_parameter(
                "head.output_weight", (vocab_dim(vocab_size), hidden_dim), settings, distributed
            )

    def forward(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits `[tokens, vocab]` of every token, whose final hidden states are `hidden` (this rank's tokens under
        sequence-tensor-parallel); of the tokens `rows` indexes (among all tokens) only, when given. Under tensor
        parallelism the vocabulary slices are gathered, without gradient: for inference (train through `loss`)."""
        hidden = self._normalized(hidden)
        distributed = self.distributed
        if distributed.tensor_size == 1:
            return F.linear(hidden if rows is None else hidden[rows], self.output_weight.to(hidden.dtype))
        group = distributed.tensor_group
        if distributed.sequence_tensor_parallel:
            hidden = gather_tokens(hidden, group)
        if rows is not None:
            hidden = hidden[rows]
        logits = F.linear(hidden, self.output_weight.to(hidden.dtype))
        return vocab_dim(self.vocab_size).local_to_global(logits, 1, group)

    def _normalized(self, hidden: torch.Tensor) -> torch.Tensor:
        # logits · m = (hidden · m) Wᵀ: scaling the normalized states scales the logits, in `forward` and in the
        # loss alike, without the loss ever holding the logits.
        return scaled(self.normalization(hidden), self.logits_multiplier)

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The cross-entropy summed over the labelled tokens (fp32), from the final hidden states of this rank's
        tokens and the labels of all tokens of the micro-batch.

        Without sequence-tensor-parallel every tensor-parallel rank returns the loss of all tokens. Under it, each
        rank returns the loss of its own tokens (their sum over the tensor group is the micro-batch's, as the
        trainer expects), while its backward gives this rank's part of the gradient of the micro-batch's loss:
        every rank computes its vocabulary slice of every token, so the loss of all tokens is known on each rank.
        """
        hidden = self._normalized(hidden)
        distributed = self.distributed
        start, _ = _vocab_slice(distributed, self.vocab_size)
        options = {"tensor_group": distributed.tensor_group, "vocab_start": start, "vocab_size": self.vocab_size}
        if not distributed.sequence_tensor_parallel:
            return linear_cross_entropy(hidden, self.output_weight, labels, **options)
        total, token_losses = linear_cross_entropy(
            hidden,
            self.output_weight,
            own_tokens(labels, distributed),
            sequence_parallel=True,
            return_token_losses=True,
            **options,
        )
        own = own_tokens(token_losses, distributed).sum()
        return total + (own - total).detach()  # the value of this rank's share, the gradient of the total


class LanguageModel(nn.Module):
    def __init__(self, config: ModelConfig, distributed: Distributed):
        super().__init__()
        self.config = config
        self.distributed = distributed
        # The files of the checkpoint of another format the weights came from (blockzoo.conversion.Origin).
        self.origin: Origin | None = None
        hidden_dim = TensorDim("hidden", config.hidden_size)
        lr_scale = scaled_lr(1.0, config.lr_scale)
        self.embeddings = Embeddings(
            config.embeddings, hidden_dim=hidden_dim, distributed=distributed, lr_scale=lr_scale
        )
        self.decoder = nn.ModuleList(
            build_part(
                block, name=f"decoder.{index}", hidden_dim=hidden_dim, distributed=distributed, lr_scale=lr_scale
            )
            for index, (_, block) in enumerate(config.decoder.expanded_blocks())
        )
        self.head = Head(
            config.head,
            hidden_dim=hidden_dim,
            vocab_size=config.embeddings.vocab_size,
            distributed=distributed,
            lr_scale=lr_scale,
            tied_weight=self.embeddings.word_embeddings if config.tied_embedding_weight else None,
        )
        if config.peft is not None:
            apply_peft(self, config.peft, distributed)

    @property
    def vocab_size(self) -> int:
        return self.config.embeddings.vocab_size

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits `[batch, sequence, vocab]` for `input_ids` `[batch, sequence]`, each row one document."""
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, sequence], got shape {tuple(input_ids.shape)}")
        rows, length = input_ids.shape
        batch = Batch([length] * rows, device=input_ids.device)
        return self.forward_packed(input_ids.reshape(-1), batch).view(rows, -1, self.vocab_size)

    def forward_packed(
        self, tokens: torch.Tensor, batch: Batch, states: Sequence | None = None, *, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits `[tokens, vocab]` of all the packed `tokens`, on every rank (gathered under tensor parallelism,
        where they carry no gradient: see `Head.forward`). `rows`: indices of the only tokens whose logits are
        computed (scoring a continuation needs its tokens' alone: the output product is a large part of a pass)."""
        return self.head(self._final_hidden(tokens, batch, states), rows)

    def loss(
        self, tokens: torch.Tensor, labels: torch.Tensor, batch: Batch | Sequence[Batch]
    ) -> tuple[torch.Tensor, dict]:
        """(Sum of the cross-entropy over the labelled tokens, the layers' named losses); the logits of all tokens
        never exist at once (`linear_cross_entropy`). Under sequence-tensor-parallel the cross-entropy is that of
        this rank's tokens (see `Head.loss`), else that of all tokens.

        `batch` may be this rank's slices of the micro-batch instead (a slice `Batch`, or the chunks of its
        micro-sequences in order; `tokens` and `labels` those of the slices, concatenated): the cross-entropy is
        then that of the slices' tokens (this rank's share of them under sequence-tensor-parallel), the named losses
        those of the whole micro-batch (`slice_losses`), the same on every rank of the sequence-data group."""
        if len(labels) != len(tokens):
            raise ValueError(f"{len(labels)} labels for {len(tokens)} tokens")
        if isinstance(batch, Batch) and not batch.is_slice:
            cross_entropy = self.head.loss(self._final_hidden(tokens, batch), labels)
            return cross_entropy, batch.losses
        slices = [batch] if isinstance(batch, Batch) else list(batch)
        hidden = self._final_hidden_of_slices(tokens, slices)
        cross_entropy = self.head.loss(hidden, self._slice_major_labels(labels, slices))
        return cross_entropy, slice_losses(slices)

    def _final_hidden(self, tokens: torch.Tensor, batch: Batch, states: Sequence | None = None) -> torch.Tensor:
        if len(tokens) != batch.num_tokens:
            raise ValueError(f"{len(tokens)} tokens for a batch of {batch.num_tokens}")
        hidden = self.embeddings(tokens, batch)
        for index, block in enumerate(self.decoder):
            hidden = block(hidden, batch, None if states is None else states[index])
        return hidden

    def _final_hidden_of_slices(self, tokens: torch.Tensor, slices: Sequence[Batch]) -> torch.Tensor:
        """The final hidden states of this rank's tokens of every slice, in order (of each slice, its tensor-parallel
        share under sequence-tensor-parallel)."""
        sizes = [batch.num_tokens for batch in slices]
        if sum(sizes) != len(tokens) or not all(batch.is_slice for batch in slices):
            raise ValueError(f"{len(tokens)} tokens for slices of {sizes} tokens (each a Batch with sequence_data)")
        carries = [None] * len(self.decoder)
        outputs = []
        for chunk, batch in zip(tokens.split(sizes), slices):
            hidden = self.embeddings(chunk, batch)
            for index, block in enumerate(self.decoder):
                hidden, carries[index] = block.forward_slice(hidden, batch, carries[index])
            outputs.append(hidden)
        return torch.cat(outputs)

    def _slice_major_labels(self, labels: torch.Tensor, slices: Sequence[Batch]) -> torch.Tensor:
        """`labels` in the order of `_final_hidden_of_slices`'s tokens gathered over the tensor group: under
        sequence-tensor-parallel with several slices, tensor rank t's shares of each slice come together (the head
        gathers them so); otherwise as they are."""
        if not self.distributed.sequence_tensor_parallel or len(slices) == 1:
            return labels
        size = self.distributed.tensor_size
        shares = [chunk.view(size, -1) for chunk in labels.split([batch.num_tokens for batch in slices])]
        return torch.cat(shares, dim=1).reshape(-1)

    def flops(self, batch: Batch) -> tuple[int, int]:
        """(forward, backward) floating-point operations over the batch, all ranks together."""
        forward = backward = 0
        for block in self.decoder:
            block_forward, block_backward = block.flops(batch)
            forward, backward = forward + block_forward, backward + block_backward
        head = 2 * batch.num_tokens * self.config.hidden_size * self.vocab_size
        return forward + head, backward + 2 * head

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        stop_token: int | Sequence[int] | None = None,
    ) -> list[list[int]]:
        """New tokens for each prompt: greedy when `temperature` is 0, else sampled (optionally from the top k); a
        sequence ends with its `stop_token` (one id, or any of several).

        Each mixer keeps its own state (KV cache, SSM state), so every step runs one token per sequence. Logits that
        are not finite (a diverged model) are refused with a `UsageError`, never turned into tokens.
        """
        if self.distributed.sequence_tensor_parallel:
            raise ValueError("generation does not support sequence-tensor-parallel; use tensor_parallel only")
        check_prompts(prompts)
        device, dtype = self.distributed.device, self.distributed.compute_dtype
        lengths = torch.tensor([len(prompt) for prompt in prompts])  # on the host: Batch reads them there
        states = [
            block.new_state(len(prompts), int(lengths.max()) + max_new_tokens, device, dtype) for block in self.decoder
        ]
        tokens = torch.tensor([token for prompt in prompts for token in prompt], device=device)
        batch = Batch(lengths, device=device, past_lengths=torch.zeros_like(lengths))
        logits = self.forward_packed(tokens, batch, states)[batch.cu_seqlens[1:].long() - 1]
        generated = GeneratedTokens(len(prompts), stop_token)
        for step in range(max_new_tokens):
            tokens = next_tokens(logits, temperature, top_k, generator, step)
            if generated.add(tokens) or step + 1 == max_new_tokens:
                break
            batch = Batch([1] * len(prompts), device=device, past_lengths=lengths)
            logits = self.forward_packed(torch.tensor(tokens, device=device), batch, states)
            lengths = lengths + 1
        return generated.outputs
