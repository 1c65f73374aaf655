"""What every way of generating shares (`LanguageModel.generate` with its caches, `PipelinedModel.generate` through
the pipeline stages): picking each sequence's next token from its logits, and collecting the new tokens until each
sequence's stop token."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from blockzoo.errors import UsageError


def check_prompts(prompts: Sequence[Sequence[int]]) -> None:
    if not prompts or any(len(prompt) == 0 for prompt in prompts):
        raise ValueError("every prompt needs at least one token")


def next_tokens(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None, step: int
) -> list[int]:
    """Each sequence's next token from its logits `[sequences, vocab]` (greedy when `temperature` is 0); logits that
    are not finite (a diverged model) are refused with a `UsageError`, never turned into tokens."""
    # One transfer to the host per step (the tokens and whether the logits were finite): on a GPU every further read
    # of a device value would wait for the device again.
    *tokens, finite = torch.cat(
        [_pick(logits.float(), temperature, top_k, generator), torch.isfinite(logits).all().long()[None]]
    ).tolist()
    if not finite:
        raise UsageError(
            f"the model's logits are not finite (nan or inf) for new token {step + 1}: its weights are "
            "unusable (did its training diverge?)"
        )
    return tokens


class GeneratedTokens:
    """Each sequence's new tokens, up to and with its stop token (one id, or any of several)."""

    def __init__(self, sequences: int, stop_token: int | Sequence[int] | None):
        self.outputs: list[list[int]] = [[] for _ in range(sequences)]
        self.finished = [False] * sequences
        self.stop_tokens = {stop_token} if isinstance(stop_token, int) else set(stop_token or ())

    def add(self, tokens: Sequence[int]) -> bool:
        """Record one new token per sequence (ignored for a finished one); whether every sequence is finished."""
        for index, token in enumerate(tokens):
            if not self.finished[index]:
                self.outputs[index].append(token)
                self.finished[index] = token in self.stop_tokens
        return all(self.finished)


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
