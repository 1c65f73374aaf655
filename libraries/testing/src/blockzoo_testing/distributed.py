"""Run a function on several CPU processes with `torchrun`'s environment, for gloo tests."""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

# Below Linux's ephemeral range (32768-60999), where gloo's own sockets take their ports: a port picked there could
# be taken by another test's gloo pair between the pick and the store binding it.
_PORTS = range(20000, 32768)
_ATTEMPTS = 3


def free_port() -> int:
    """A port nobody listens on now, outside the ephemeral range, chosen at random so that parallel test workers
    do not collide."""
    generator = random.SystemRandom()
    while True:
        port = generator.choice(_PORTS)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def run_distributed(world_size: int, function: Callable, *args: object) -> None:
    """Call `function(*args)` in `world_size` fresh processes; the first failure is raised here with its traceback.

    `function` must be importable (module level). The processes see WORLD_SIZE, RANK, LOCAL_RANK,
    MASTER_ADDR and MASTER_PORT as under `torchrun`, so `Distributed` starts as it would in a run. A port taken
    between its choice and its use (by another process: "address already in use") is retried on another port, at
    most three times; any other failure is raised at once.
    """
    for attempt in range(_ATTEMPTS):
        try:
            mp.start_processes(
                _worker, args=(world_size, free_port(), function, args), nprocs=world_size, start_method="spawn"
            )
            return
        except mp.ProcessRaisedException as error:
            if "address already in use" not in str(error).lower() or attempt + 1 == _ATTEMPTS:
                raise


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
