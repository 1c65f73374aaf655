"""Checks of a batch against a generation cache `[sequences, max_length, ...]`, for attention-like mixers that keep
one per sequence (attention's keys and values, multi-head latent attention's latents). Public: their messages are
what a user sees when a generation loop passes the wrong batch."""

from __future__ import annotations

import torch

from blockzoo.api import Batch


def check_cached_batch(batch: Batch, cache: torch.Tensor, owner: str) -> None:
    """Refuse a batch without `past_lengths` (not a generation step) or whose documents are not the cache's
    sequences; `owner` names the mixer in the message ("attention")."""
    if batch.past_lengths is None:
        raise ValueError(f"{owner} with a generation cache needs `batch.past_lengths`")
    sequences = cache.shape[0]
    if batch.num_documents != sequences:
        raise ValueError(f"the batch has {batch.num_documents} sequences but the cache holds {sequences}")


def check_cache_length(stored: int, cache: torch.Tensor) -> None:
    """Refuse sequences of `stored` tokens (after the batch) longer than the cache."""
    max_length = cache.shape[1]
    if stored > max_length:
        raise ValueError(f"sequences of up to {stored} tokens exceed the cache's {max_length}")
