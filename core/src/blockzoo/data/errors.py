"""The error of bad data inputs: the CLI reports it in one paragraph with exit code 2, like a bad config."""

from __future__ import annotations

from blockzoo.errors import UsageError


class DatasetError(UsageError):
    """A dataset, corpus or tokenizer file is missing, malformed or does not fit the model."""
