"""The run's progress on a terminal: a tqdm bar on stderr (steps done, rate, elapsed time and ETA, the last logged
loss) when stderr is a terminal; nothing otherwise (CI, a log file: the step lines say where the run is). Log lines
are written through tqdm, so they never break the bar. `TQDM_DISABLE=1` turns the bar off."""

from __future__ import annotations

import sys

from tqdm import tqdm


def write_line(message: str) -> None:
    """Print a log line to stdout, above the progress bar when there is one."""
    tqdm.write(message, file=sys.stdout)
    sys.stdout.flush()


class Progress:
    """A context manager: the bar of steps `initial`..`total` when `enabled` and stderr is a terminal."""

    def __init__(self, *, total: int, initial: int, enabled: bool):
        shown = enabled and sys.stderr.isatty()
        self.bar = tqdm(
            total=total,
            initial=initial,
            unit="step",
            desc="training",
            file=sys.stderr,
            dynamic_ncols=True,
            disable=not shown,
        )

    def advance(self, loss: float | None = None) -> None:
        """One step done; `loss`: the step's loss, when it was logged."""
        if loss is not None:
            self.bar.set_postfix_str(f"loss {loss:.4f}", refresh=False)
        self.bar.update(1)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.bar.close()
