"""The tokenizer of a model: the `tokenizer.json` of the Hugging Face checkpoint it was imported from, else its
training data's (`blockzoo generate`, `blockzoo evaluate`, benchmarks during training)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from blockzoo.data.errors import DatasetError
from blockzoo.data.tokenizer import Tokenizer, origin_tokenizer
from blockzoo.errors import UsageError
from blockzoo.plugins import get_registry


def model_tokenizer(
    model: Any,
    run_config: Any = None,
    *,
    checkpoint: str | Path | None = None,
    dataset: Any = None,
    purpose: str = "encode text",
) -> tuple[Tokenizer, list[int]]:
    """(tokenizer, ids that end a generation) of `model` (a `LanguageModel`), trained by `run_config` (default: the
    one `blockzoo.load` attaches to the model). `checkpoint`:
    where it was loaded from (said in errors); `dataset`: its training data already built (else built here from the
    run config, read for its tokenizer only). A `UsageError` says why there is none."""
    if (found := origin_tokenizer(model.origin)) is not None:
        return found
    if model.origin is not None and checkpoint is not None and model.origin.directory == Path(checkpoint):
        raise UsageError(f"{checkpoint} has no tokenizer.json to {purpose} with")
    run_config = run_config or model.run_config
    data_type = get_registry().name_of(type(run_config.data))
    if dataset is None:
        from blockzoo.data.dataset import build_dataset

        vocab_size = run_config.model.embeddings.vocab_size  # (random data takes the model's)
        try:
            dataset = build_dataset(run_config.data, seed=run_config.distributed.seed, model_vocab_size=vocab_size)
        except DatasetError as error:
            where = checkpoint or "the model"
            raise UsageError(
                f"{where} carries no tokenizer.json, and its training data ({data_type} type) cannot give one: {error}"
            ) from None
    tokenizer = dataset.tokenizer
    if tokenizer is None:
        raise UsageError(f"the checkpoint's data ({data_type} type) has no tokenizer to {purpose} with")
    stop = getattr(tokenizer, "eod_token_id", None)
    return tokenizer, [] if stop is None else [stop]
