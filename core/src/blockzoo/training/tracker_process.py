"""A tracker in a child process of its own (`separate_process: true`, the default of the first-party trackers of
other libraries). Torch-free.

A tracker on a thread of the training process takes the interpreter (the GIL) from the training loop for as long as
its Python runs: wandb's `log` about 0.5 ms, MLflow's batching 1.3 ms, TensorBoard's events 0.15 ms per logged step,
so that logging every step of a 13 ms step cost 8 % of the process's CPU and as much of the loop's time wherever the
loop itself needs the interpreter (a GPU step is mostly Python dispatch). In a child process the tracker's work runs
on another interpreter: what stays in the training process is the tracker's worker thread pickling the entry onto a
pipe (tens of microseconds), the loop paying its queue put as before.

`ChildProcessTracker` is a `Tracker` like any other to the host (`Trackers`): its `start`, `log` and `finish` forward
the calls to the child (`python -m blockzoo.training.tracker_process FD`), which builds the real tracker from its
config through the same plugin registry and calls it in order. A failure in the child (its library missing, an
exception in a call) comes back as its type's name and message, raised by the next call of the proxy as an exception of
that name (the built-in type itself for Python's own), so the host reports it as it reports any tracker's failure.
The child answers with tuples of strings only: no object of the tracker's library travels back into the training
process. `start` and `finish` wait for the child's answer (a run that needs its trackers waits for their start; the
end waits for their finish, within the host's limit). The child ignores SIGINT and
SIGTERM (the training process handles them and finishes its trackers, `interrupted`), ends when the training process
closes its end of the pipe, and is killed by the kernel if the training process dies (Linux's parent-death signal),
as a tracker thread dies with its process.
"""

from __future__ import annotations

import builtins
import contextlib
import multiprocessing.connection
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from blockzoo.training.tracking import RunStatus, Tracker, TrackerRun
from blockzoo.training.tracking_config import TrackerConfig

EXIT_SECONDS = 30.0  # how long a child that answered its finish may take to exit before it is killed


class TrackerProcessError(RuntimeError):
    """The tracker's child process ended without an answer, or failed with an error of a type that is not Python's
    own (a subclass named as that type is raised)."""


class ChildProcessTracker(Tracker):
    """`config`'s tracker, run in a child process (module docstring); this object forwards the calls to it."""

    def __init__(self, config: TrackerConfig):
        super().__init__(config)
        self.process: subprocess.Popen | None = None
        self.connection: multiprocessing.connection.Connection | None = None

    def start(self, run: TrackerRun) -> None:
        ours, theirs = multiprocessing.Pipe(duplex=True)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "blockzoo.training.tracker_process", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        self.connection = ours
        try:
            self._send(("start", self.config, run))
            self._answer()
        except BaseException:
            self._close()  # the host calls nothing more after a failure
            raise

    def log(self, step: int, entry: Mapping[str, Any]) -> None:
        self._raise_sent_failure()
        self._send(("log", step, entry))

    def finish(self, status: RunStatus) -> None:
        try:
            self._raise_sent_failure()
            self._send(("finish", status))
            self._answer()
        finally:
            self._close()

    # -- the pipe ------------------------------------------------------------------------------------------------------

    def _send(self, message: tuple) -> None:
        try:
            self.connection.send(message)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            self._raise_sent_failure()  # the child's own error, if it sent one before it ended
            raise self._ended() from None

    def _answer(self) -> None:
        """Wait for the child's answer to a start or finish: done, or its error raised here."""
        try:
            answer = self.connection.recv()
        except (EOFError, ConnectionResetError):
            raise self._ended() from None
        if answer[0] == "failed":
            raise _error(*answer[1:])

    def _raise_sent_failure(self) -> None:
        """Raise the error the child sent (it ended after a failed call), if it sent one."""
        with contextlib.suppress(EOFError, ConnectionResetError, OSError):
            while self.connection.poll():
                answer = self.connection.recv()
                if answer[0] == "failed":
                    raise _error(*answer[1:])
                return

    def _ended(self) -> TrackerProcessError:
        code = self.process.poll() if self.process is not None else None
        state = "still running" if code is None else f"exit code {code}"
        return TrackerProcessError(f"the tracker's process ended without an answer ({state})")

    def _close(self) -> None:
        if self.connection is not None:
            self.connection.close()
        if self.process is not None:
            try:
                self.process.wait(EXIT_SECONDS)
            except subprocess.TimeoutExpired:
                self.process.kill()


def _error(name: str, message: str) -> BaseException:
    """The child's error from its type's name and message: Python's own type where it is one, else a
    `TrackerProcessError` of that name."""
    builtin = getattr(builtins, name, None)
    if isinstance(builtin, type) and issubclass(builtin, Exception):
        with contextlib.suppress(Exception):  # a built-in whose constructor wants more than a message
            return builtin(message)
    return type(name, (TrackerProcessError,), {})(message)


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when the training process dies (a tracker thread dies with it too)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before the request: nobody would send the signal
            os._exit(1)


def serve(connection: multiprocessing.connection.Connection) -> None:
    """The child: build the tracker of the first message's config and call it as messages arrive, until `finish`,
    a failure (sent back, then the end) or the training process closing the pipe."""
    from blockzoo.plugins import get_registry

    tracker = None
    try:
        while True:
            try:
                message = connection.recv()
            except EOFError:  # the training process is gone, or dropped us: as a killed run, nothing more is said
                return
            kind = message[0]
            if kind == "start":
                config, run = message[1], message[2]
                tracker = get_registry().implementation_of(config)(config)
                tracker.start(run)
                connection.send(("started",))
            elif kind == "log":
                tracker.log(message[1], message[2])
            elif kind == "finish":
                tracker.finish(message[1])
                connection.send(("finished",))
                return
    except BaseException as error:  # noqa: BLE001 - every failure goes back to the training process
        with contextlib.suppress(OSError):
            connection.send(("failed", type(error).__name__, str(error)))


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the training process handles them, and finishes us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    connection = multiprocessing.connection.Connection(int(argv[0]))
    try:
        serve(connection)
    finally:
        connection.close()


if __name__ == "__main__":
    main(sys.argv[1:])
