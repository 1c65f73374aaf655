"""`blockzoo_testing.run_distributed`: real gloo ranks, and a master port taken meanwhile is retried elsewhere."""

import socket

import pytest
import torch
import torch.distributed as dist

import blockzoo_testing.distributed
from blockzoo_testing.distributed import free_port, run_distributed


def _sum_of_ranks(expected: int) -> None:
    dist.init_process_group("gloo")
    try:
        total = torch.tensor([dist.get_rank()])
        dist.all_reduce(total)
        assert total.item() == expected
    finally:
        dist.destroy_process_group()


def _fails() -> None:
    raise ValueError("a real failure")


@pytest.mark.distributed
def test_a_port_taken_before_the_ranks_bind_it_is_retried(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [taken.getsockname()[1], free_port()]
        monkeypatch.setattr(blockzoo_testing.distributed, "free_port", lambda: ports.pop(0))
        run_distributed(2, _sum_of_ranks, 1)
    assert ports == []  # the taken port, then the other


@pytest.mark.distributed
def test_other_failures_are_raised_at_once(monkeypatch):
    picked = []
    monkeypatch.setattr(blockzoo_testing.distributed, "free_port", lambda: picked.append(free_port()) or picked[-1])
    with pytest.raises(Exception, match="a real failure"):
        run_distributed(2, _fails)
    assert len(picked) == 1
    assert all(20000 <= free_port() < 32768 for _ in range(20))  # below the ephemeral ports gloo's sockets take
