"""The exchanges between the slices of a sequence-data-parallel group (`blockzoo.distributed.sequence`): on 3 gloo
ranks, forward values and the gradients each rank gets equal a single-process computation over all the slices."""

import pytest
import torch
import torch.distributed as dist

from blockzoo.distributed.sequence import gather_slices, gather_slices_detached, previous_slice, sum_over_slices
from blockzoo_testing.distributed import run_distributed

RANKS, ROWS, WIDTH = 3, 2, 5


def _slices() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(ROWS, WIDTH, generator=generator, dtype=torch.float64) for _ in range(RANKS)]


def _weights(rank: int) -> list[torch.Tensor]:
    """The weights of rank `rank`'s objective: on the gathered rows, the previous slice, the sum."""
    generator = torch.Generator().manual_seed(100 + rank)
    shapes = [(RANKS * ROWS, WIDTH), (ROWS, WIDTH), (ROWS, WIDTH)]
    return [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]


def _objective(rank: int, gathered, previous) -> torch.Tensor:
    on_gathered, on_previous, _ = _weights(rank)
    return (gathered * on_gathered).sum() + (previous.square() * on_previous).sum()


def _reference() -> list[torch.Tensor]:
    """Each slice's gradient of Σ_r objective_r plus the statistics' term once, in one process."""
    slices = [tensor.clone().requires_grad_() for tensor in _slices()]
    gathered = torch.cat(slices)
    total = sum(
        _objective(rank, gathered, slices[rank - 1] if rank else torch.zeros(ROWS, WIDTH, dtype=torch.float64))
        for rank in range(RANKS)
    )
    summed = sum(slices)
    total = total + (summed.sin() * _weights(0)[2]).sum()  # the statistics' function, counted once
    total.backward()
    return [tensor.grad for tensor in slices]


def _on_each_rank(expected_grads: list[torch.Tensor]) -> None:
    dist.init_process_group("gloo")
    try:
        rank, group = dist.get_rank(), dist.group.WORLD
        mine = _slices()[rank].clone().requires_grad_()
        gathered = gather_slices(mine, group)
        torch.testing.assert_close(gathered.detach(), torch.cat(_slices()))
        torch.testing.assert_close(gather_slices_detached(mine, group), torch.cat(_slices()))
        previous = previous_slice(mine, group)
        wanted = _slices()[rank - 1] if rank else torch.zeros(ROWS, WIDTH, dtype=torch.float64)
        torch.testing.assert_close(previous.detach(), wanted)
        summed = sum_over_slices(mine, group)
        torch.testing.assert_close(summed.detach(), sum(_slices()))
        # Every rank's objective holds the statistics' function in full: its gradient passes to each slice once.
        objective = _objective(rank, gathered, previous) + (summed.sin() * _weights(0)[2]).sum()
        objective.backward()
        torch.testing.assert_close(mine.grad, expected_grads[rank])
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_exchanges_between_slices_match_one_process():
    run_distributed(RANKS, _on_each_rank, _reference())


def test_without_a_group_the_exchanges_act_on_one_slice():
    tensor = torch.randn(ROWS, WIDTH)
    assert gather_slices(tensor, None) is tensor and sum_over_slices(tensor, None) is tensor
    assert not previous_slice(tensor, None).any()
