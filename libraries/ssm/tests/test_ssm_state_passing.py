"""blockzoo_ssm's slice functions under sequence-data parallelism, on gloo: the convolution's halo and the SSM state
passed over the group (`blockzoo_ssm.state_passing`) give the outputs, the carry and every gradient of the whole
sequence in one process (float64).

One spawn of 4 ranks runs sdp4 (the world) and sdp2 (two groups of two, side by side); each sequence is run as
consecutive group steps (a micro-sequence of size × slice tokens each, the carry passed from step to step), with
documents that straddle rank and step boundaries, documents shorter than a slice, one-token documents, boundaries
on document boundaries, slices inside one document (the state carried through them), and slices shorter than the
convolution's kernel_size - 1 (its halo reaches over several ranks and the previous step).
"""

import datetime

import pytest
import torch
import torch.distributed as dist
from test_ssm_numerics import conv_inputs, selective_inputs, ssd_inputs

from blockzoo.layers.base import SequenceData, slice_batch
from blockzoo_ssm import (
    causal_conv1d,
    causal_conv1d_slice,
    selective_scan,
    selective_scan_slice,
    ssd_scan,
    ssd_scan_slice,
)
from blockzoo_testing.distributed import run_distributed

F64 = torch.float64
WORLD = 4
# 32 tokens: boundaries at 5, 6, 13, 16, 20, 21, 22; the last document covers the last 10 tokens.
LENGTHS = [5, 1, 7, 3, 4, 1, 1, 10]
TOLERANCE = {"rtol": 1e-10, "atol": 1e-10}


def _ssd(scale_input):
    x, dt, A, B, C = ssd_inputs(LENGTHS, heads=4, groups=2)
    generator = torch.Generator().manual_seed(3)
    D, dt_bias = torch.randn(4, generator=generator, dtype=F64), torch.randn(4, generator=generator, dtype=F64)
    options = {"chunk_size": 3, "scale_input": scale_input, "dt_softplus": scale_input}
    if not scale_input:
        dt_bias = None
    constants = (A, D) if dt_bias is None else (A, D, dt_bias)

    def whole(x, dt, B, C, A, D, dt_bias=None):
        return ssd_scan(x, dt, A, B, C, slice_batch(LENGTHS, 0, 32), D=D, dt_bias=dt_bias, **options)

    def sliced(x, dt, B, C, A, D, *rest, batch, previous):
        dt_bias = rest[0] if rest else None
        return ssd_scan_slice(x, dt, A, B, C, batch, previous, D=D, dt_bias=dt_bias, **options)

    return (x, dt, B, C), constants, whole, sliced


def _selective():
    u, delta, A, B, C = selective_inputs(LENGTHS)

    def whole(u, delta, B, C, A):
        return selective_scan(u, delta, A, B, C, slice_batch(LENGTHS, 0, 32))

    def sliced(u, delta, B, C, A, *, batch, previous):
        return selective_scan_slice(u, delta, A, B, C, batch, previous)

    return (u, delta, B, C), (A,), whole, sliced


def _conv():
    x, weight, bias = conv_inputs(LENGTHS, kernel_size=4)

    def whole(x, weight, bias):
        return causal_conv1d(x, weight, bias, slice_batch(LENGTHS, 0, 32), activation="silu")

    def sliced(x, weight, bias, *, batch, previous):
        return causal_conv1d_slice(x, weight, bias, batch, previous, activation="silu")

    return (x,), (weight, bias), whole, sliced


# name -> (inputs, slice length)
CASES = {
    "ssd": (lambda: _ssd(True), 4),
    "ssd-unscaled-input": (lambda: _ssd(False), 4),
    "selective": (_selective, 4),
    "convolution": (_conv, 4),
    "convolution-slices-shorter-than-the-kernel": (_conv, 2),
}


def _check(case: str, group, rank: int, size: int) -> list[str]:
    """Failures of one case on one rank (each rank runs the whole sequence in one process as the reference)."""
    make, slice_length = CASES[case]
    per_token, constants, whole, sliced = make()
    leaves = [tensor.clone().requires_grad_() for tensor in (*per_token, *constants)]
    weights = torch.randn(32, *whole(*per_token, *constants).shape[1:], generator=torch.Generator().manual_seed(7))
    weights = weights.to(F64)
    expected = whole(*leaves)
    expected_grads = torch.autograd.grad((expected * weights).sum(), leaves)

    leaves = [tensor.clone().requires_grad_() for tensor in (*per_token, *constants)]
    tokens, parameters = leaves[: len(per_token)], leaves[len(per_token) :]
    step = size * slice_length
    objective, failures, previous = 0, [], None
    for start in range(rank * slice_length, 32, step):
        stop = start + slice_length
        batch = slice_batch(LENGTHS, start, stop, sequence_data=SequenceData(group, rank, size))
        y, previous = sliced(*(tensor[start:stop] for tensor in tokens), *parameters, batch=batch, previous=previous)
        objective = objective + (y * weights[start:stop]).sum()
        failures += _compare(y, expected[start:stop], f"{case} sdp{size} rank {rank}: output of [{start}, {stop})")
    # The carry: the convolution's last kernel_size - 1 inputs, or the state after the last token.
    final = per_token[0][-3:] if case.startswith("convolution") else _final_state(case, per_token, constants)
    failures += _compare(previous, final, f"{case} sdp{size} rank {rank}: carry after the sequence")
    objective.backward()
    for index, (leaf, wanted) in enumerate(zip(leaves, expected_grads)):
        grad = leaf.grad.clone()
        dist.all_reduce(grad, group=group)  # each rank holds the gradient of its slices (and its share of the rest)
        failures += _compare(grad, wanted, f"{case} sdp{size} rank {rank}: gradient of input {index}")
    return failures


def _final_state(case, per_token, constants):
    """The state after the sequence's last token, from the whole-sequence function."""
    batch = slice_batch(LENGTHS, 0, 32)
    if case == "selective":
        u, delta, B, C = per_token
        return selective_scan(u, delta, constants[0], B, C, batch, return_final_state=True)[1]
    x, dt, B, C = per_token
    scale_input = case == "ssd"
    A, D, *rest = constants
    return ssd_scan(
        x, dt, A, B, C, batch, chunk_size=3, D=D, scale_input=scale_input, dt_softplus=scale_input,
        dt_bias=rest[0] if rest else None, return_final_state=True,
    )[1]  # fmt: skip


def _compare(actual, expected, what) -> list[str]:
    try:
        torch.testing.assert_close(actual.detach(), expected.detach(), **TOLERANCE)
    except AssertionError as error:
        return [f"{what}: {str(error).splitlines()[0:3]}"]
    return []


def _on_each_rank() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        rank = dist.get_rank()
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
        failures = []
        for size, group in [(4, dist.group.WORLD), (2, pairs[rank // 2])]:
            for case in CASES:
                failures += _check(case, group, rank % size, size)
        assert not failures, "\n".join(failures)
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_slices_over_sequence_data_groups_equal_the_whole_sequence():
    run_distributed(WORLD, _on_each_rank)
