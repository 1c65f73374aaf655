"""Run a function on several CPU processes with `torchrun`'s environment, for gloo tests."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    """A port nobody listens on now: the OS picks it, so parallel test workers do not collide."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_distributed(world_size: int, function: Callable, *args: object) -> None:
    """Call `function(*args)` in `world_size` fresh processes; the first failure is raised here with its traceback.

    `function` must be importable (module level). The processes see WORLD_SIZE, RANK, LOCAL_RANK,
    MASTER_ADDR and MASTER_PORT as under `torchrun`, so `Distributed` starts as it would in a run.
    """
    mp.start_processes(_worker, args=(world_size, free_port(), function, args), nprocs=world_size, start_method="spawn")


def _worker(rank: int, world_size: int, port: int, function: Callable, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)  # The ranks share a few cores.
    function(*args)
