"""How a run stops: on an error the run cannot go on from (`TrainingError`), or on SIGTERM / SIGINT (`StopSignals`):
the first ends the run at the next step boundary (saving a checkpoint there), a second at once (`Stopped`)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from blockzoo.distributed.runtime import Distributed


class TrainingError(RuntimeError):
    """The run cannot go on (a non-finite loss, ...); the last checkpoint is intact."""

    exit_code = 1


class Stopped(TrainingError):
    """A second SIGTERM / SIGINT stopped the run at once."""

    def __init__(self, signal_number: int, message: str = ""):
        self.signal_number = signal_number
        self.exit_code = 128 + signal_number  # the shell's convention for a process ended by a signal
        super().__init__(message or f"stopped by a second {signal.Signals(signal_number).name}")


class StopSignals:
    """While active (a context manager, in the main thread): the first SIGTERM / SIGINT is recorded (`received`),
    a second raises `Stopped`. The previous handlers come back on exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, log: Callable[[str], None]):
        self._log = log
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, number: int, _frame: object) -> None:
        if self.received is not None:
            raise Stopped(number)
        self.received = number
        self._log(
            f"received {signal.Signals(number).name}: saving a checkpoint at the end of this step, then stopping "
            "(a second signal stops at once)"
        )

    def any_rank_received(self, distributed: Distributed) -> bool:
        """Whether any rank received a stop signal (every rank calls it at every step boundary)."""
        stop = self.received is not None
        if distributed.world_size > 1:
            flag = torch.tensor([int(stop)], dtype=torch.int32, device=distributed.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = bool(flag.item())
        return stop

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for number in self.SIGNALS:
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
