"""The language model: embeddings → block sequence → head, over packed documents.

Under sequence-tensor-parallel each rank embeds, normalizes and projects only its own contiguous
slice of the tokens: the replicated embedding, norm and output weights then see token shards, and
their gradients are summed over the tensor group (see `create_parameter`'s `token_sharded_input`).
Each rank's loss covers its own tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from blockzoo.conversion import Origin
from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.base import IGNORE_INDEX, Batch
from blockzoo.layers.config import NormalInitializationConfig
from blockzoo.layers.dims import TensorDim
from blockzoo.layers.parameter import create_parameter
from blockzoo.model.block import build_part
from blockzoo.model.config import EmbeddingsConfig, HeadConfig, ModelConfig


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


def _scaled(lr_scale: float, own: float | None) -> float:
    return lr_scale * (1.0 if own is None else own)


class Embeddings(nn.Module):
    def __init__(self, config: EmbeddingsConfig, *, hidden_dim: TensorDim, distributed: Distributed, lr_scale: float):
        super().__init__()
        self.distributed = distributed
        lr_scale = _scaled(lr_scale, config.lr_scale)
        initialization = NormalInitializationConfig(std=hidden_dim.global_size**-0.5)
        settings = config.word_embeddings.resolve(initialization=initialization, lr_scale=lr_scale)
        vocab_dim = TensorDim("vocab", config.vocab_size)
        self.word_embeddings = create_parameter(
            "embeddings.word_embeddings", (vocab_dim, hidden_dim), settings, distributed, token_sharded_input=True
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
        tokens = own_tokens(tokens, self.distributed)
        hidden = F.embedding(tokens, self.word_embeddings)
        if self.position_embeddings is not None:
            positions = own_tokens(batch.positions, self.distributed)
            if len(positions) and int(positions.max()) >= len(self.position_embeddings):
                raise ValueError(
                    f"position {int(positions.max())} is beyond the {len(self.position_embeddings)} learned positions "
                    "(model.embeddings.num_position_embeddings)"
                )
            hidden = hidden + F.embedding(positions, self.position_embeddings)
        return hidden.to(self.distributed.compute_dtype)


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
        lr_scale = _scaled(lr_scale, config.lr_scale)
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
                "head.output_weight",
                (TensorDim("vocab", vocab_size), hidden_dim),
                settings,
                distributed,
                token_sharded_input=True,
            )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.normalization(hidden)
        return F.linear(hidden, self.output_weight.to(hidden.dtype))


class LanguageModel(nn.Module):
    def __init__(self, config: ModelConfig, distributed: Distributed):
        super().__init__()
        self.config = config
        self.distributed = distributed
        # The files of the checkpoint of another format the weights came from (blockzoo.conversion.Origin).
        self.origin: Origin | None = None
        hidden_dim = TensorDim("hidden", config.hidden_size)
        lr_scale = _scaled(1.0, config.lr_scale)
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

    def forward_packed(self, tokens: torch.Tensor, batch: Batch, states: Sequence | None = None) -> torch.Tensor:
        """Logits of this rank's tokens (all of them unless sequence-tensor-parallel) for packed `tokens`."""
        if len(tokens) != batch.num_tokens:
            raise ValueError(f"{len(tokens)} tokens for a batch of {batch.num_tokens}")
        hidden = self.embeddings(tokens, batch)
        for index, block in enumerate(self.decoder):
            hidden = block(hidden, batch, None if states is None else states[index])
        return self.head(hidden)

    def loss(self, tokens: torch.Tensor, labels: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, dict]:
        """(Sum of the cross-entropy over this rank's labelled tokens, the layers' named losses)."""
        logits = self.forward_packed(tokens, batch)
        labels = own_tokens(labels, self.distributed)
        cross_entropy = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
        return cross_entropy, batch.losses

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

        Each mixer keeps its own state (KV cache, SSM state), so every step runs one token per sequence.
        """
        if self.distributed.sequence_tensor_parallel:
            raise ValueError("generation does not support sequence-tensor-parallel; use tensor_parallel only")
        if not prompts or any(len(prompt) == 0 for prompt in prompts):
            raise ValueError("every prompt needs at least one token")
        device, dtype = self.distributed.device, self.distributed.compute_dtype
        lengths = torch.tensor([len(prompt) for prompt in prompts], device=device)
        states = [
            block.new_state(len(prompts), int(lengths.max()) + max_new_tokens, device, dtype) for block in self.decoder
        ]
        tokens = torch.tensor([token for prompt in prompts for token in prompt], device=device)
        batch = Batch(lengths, device=device, past_lengths=torch.zeros_like(lengths))
        logits = self.forward_packed(tokens, batch, states)[batch.cu_seqlens[1:].long() - 1]
        outputs: list[list[int]] = [[] for _ in prompts]
        finished = torch.zeros(len(prompts), dtype=torch.bool, device=device)
        stop_tokens = [stop_token] if isinstance(stop_token, int) else list(stop_token or ())
        stop_tokens = torch.tensor(stop_tokens, dtype=torch.long, device=device)
        for step in range(max_new_tokens):
            next_tokens = _pick(logits.float(), temperature, top_k, generator)
            for index, token in enumerate(next_tokens.tolist()):
                if not finished[index]:
                    outputs[index].append(token)
            if len(stop_tokens):
                finished |= torch.isin(next_tokens, stop_tokens)
                if bool(finished.all()):
                    break
            if step + 1 == max_new_tokens:
                break
            batch = Batch([1] * len(prompts), device=device, past_lengths=lengths)
            logits = self.forward_packed(next_tokens, batch, states)
            lengths = lengths + 1
        return outputs


def _pick(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        threshold = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    probabilities = torch.softmax(logits, dim=-1)
    return torch.multinomial(probabilities.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)
