"""`blockzoo prepare`'s progress on a terminal: a tqdm bar on stderr of the input bytes read (its ETA), with the
documents and tokens per second; nothing when stderr is not a terminal (`TQDM_DISABLE=1` turns it off too), as
the training bar (`blockzoo.training.progress`)."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


class PrepareProgress:
    """A context manager; `advance(documents, tokens, input_bytes)` adds what was done."""

    def __init__(self, *, total_bytes: int, enabled: bool):
        self.bar = tqdm(
            total=total_bytes,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc="preparing",
            file=sys.stderr,
            dynamic_ncols=True,
            disable=not (enabled and sys.stderr.isatty()),
        )
        self.documents = 0
        self.tokens = 0
        self.start = time.monotonic()

    def advance(self, documents: int, tokens: int, input_bytes: int) -> None:
        self.documents += documents
        self.tokens += tokens
        elapsed = max(time.monotonic() - self.start, 1e-9)
        self.bar.set_postfix_str(
            f"{self.documents / elapsed:,.0f} docs/s, {self.tokens / elapsed:,.0f} tokens/s", refresh=False
        )
        self.bar.update(input_bytes)

    def __enter__(self) -> PrepareProgress:
        return self

    def __exit__(self, kind: type | None, *_: object) -> None:
        if kind is None:
            self.bar.update(self.bar.total - self.bar.n)
        self.bar.close()
