"""Inference through the pipeline stages: a pipelined model as inference code (a benchmark backend) sees a
`LanguageModel`. `forward_packed` runs the packed tokens forward through the stages (`Pipeline.logits`: every
pipeline rank gets the last stage's logits) and `generate` decodes by running the whole sequences again for each
new token: the stages hold no cache, and the sequences evaluation generates are short."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from blockzoo.distributed.data_parallel import gathered_for_inference
from blockzoo.distributed.pipeline import Pipeline
from blockzoo.layers.base import Batch
from blockzoo.model.generation import GeneratedTokens, check_prompts, next_tokens


class PipelinedModel:
    """`pipeline`'s model for inference: `forward_packed` and `generate` through the stages, every other attribute
    (config, origin, distributed, eval/train, ...) the model's own. Every rank of the pipeline calls the same
    methods with the same arguments, as with tensor parallelism."""

    def __init__(self, pipeline: Pipeline):
        self.pipeline = pipeline
        self.model = pipeline.model

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def forward_packed(
        self, tokens: torch.Tensor, batch: Batch, states: Sequence | None = None, *, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        if states is not None:
            raise ValueError("a pipelined model keeps no inference states (caches) across forward passes")
        return self.pipeline.logits(tokens, batch, rows)

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
        """As `LanguageModel.generate`, each new token from the whole sequence run through the stages again. Every
        pipeline rank picks the same tokens: the same logits (broadcast) and, when sampling, the same generator
        state (the ranks are seeded alike)."""
        check_prompts(prompts)
        device = self.model.distributed.device
        sequences = [list(prompt) for prompt in prompts]
        generated = GeneratedTokens(len(prompts), stop_token)
        for step in range(max_new_tokens):
            batch = Batch([len(sequence) for sequence in sequences], device=device)
            tokens = torch.tensor([token for sequence in sequences for token in sequence], device=device)
            logits = self.forward_packed(tokens, batch, rows=batch.cu_seqlens[1:].long() - 1)
            picked = next_tokens(logits, temperature, top_k, generator, step)
            for sequence, token in zip(sequences, picked, strict=True):
                sequence.append(token)
            if generated.add(picked):
                break
        return generated.outputs


@contextlib.contextmanager
def gathered_stages(pipeline: Pipeline) -> Iterator[None]:
    """`gathered_for_inference` over each of this rank's stages (each an FSDP root under ZeRO / FSDP)."""
    with contextlib.ExitStack() as stack:
        for stage in pipeline.modules:
            stack.enter_context(gathered_for_inference(stage, pipeline.distributed))
        yield
