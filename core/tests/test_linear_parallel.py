"""Tensor-parallel linears and the runtime: every layout gives the single-process outputs and gradients.

The multi-process tests start one set of processes per world size (gloo on CPU; NCCL where two GPUs
are present) and run every case in it, since a spawn costs seconds; each rank builds the
single-process reference itself, from the same seed.
"""

import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from blockzoo.distributed.check import ParallelMismatchError, check_parallel_match
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.runtime import Distributed
from blockzoo.errors import UsageError
from blockzoo.layers.config import (
    BiasConfig,
    FillInitializationConfig,
    LinearConfig,
    NormalInitializationConfig,
    ParameterConfig,
    ResolvedParameter,
    UniformInitializationConfig,
)
from blockzoo.layers.dims import ConcatenatedTensorDim, TensorDim
from blockzoo.layers.linear import Linear
from blockzoo.layers.parameter import create_parameter
from blockzoo_testing.distributed import run_distributed

# fp32; the parallel runs sum in a different order than the single process.
TOLERANCE = {"atol": 1e-6, "rtol": 1e-5}
TOKENS, HIDDEN, INTERMEDIATE = 8, 16, 24
SEED = 4321


class GatedMLP(nn.Module):
    """Column-parallel gate‖up (a different init and lr_scale per component), row-parallel down, and a
    replicated linear on the same input (its gradient needs the tensor-group sum under sequence-tensor-parallel)."""

    def __init__(self, distributed: Distributed):
        super().__init__()
        hidden = TensorDim("hidden", HIDDEN)
        self.gate_up_dim = ConcatenatedTensorDim(
            "gate_up", [TensorDim("gate", INTERMEDIATE, parallel=True), TensorDim("up", INTERMEDIATE, parallel=True)]
        )
        self.tp_size = distributed.tensor_size
        biased = BiasConfig(enabled=True, initialization=NormalInitializationConfig(std=0.5))
        default = NormalInitializationConfig(std=0.2)
        self.gate_up = Linear(
            "mlp.gate_up",
            [
                LinearConfig(bias=biased),
                LinearConfig(
                    weight=ParameterConfig(initialization=UniformInitializationConfig(low=-0.3, high=0.3)), lr_scale=0.5
                ),
            ],
            hidden,
            self.gate_up_dim,
            distributed,
            default_initialization=default,
            default_bias=True,
        )
        intermediate = TensorDim("intermediate", INTERMEDIATE, parallel=True)
        self.down = Linear(
            "mlp.down", LinearConfig(bias=biased), intermediate, hidden, distributed, default_initialization=default
        )
        self.router = Linear(
            "mlp.router",
            LinearConfig(bias=biased),
            hidden,
            TensorDim("experts", 4),
            distributed,
            default_initialization=default,
        )

    def forward(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up = self.gate_up(input)
        gate, up = (gate_up[:, rows] for rows in self.gate_up_dim.component_slices(self.tp_size))
        return self.down(F.silu(gate) * up), self.router(input)


def _settings() -> ResolvedParameter:
    return ResolvedParameter(initialization=FillInitializationConfig(), lr_scale=1.0, weight_decay=True)


def _single_process(backend: str = "gloo", local_rank: int = 0) -> Distributed:
    """The reference: one process, on the CPU (gloo) or on this rank's GPU (nccl)."""
    return Distributed(DistributedConfig(seed=SEED, backend=backend), world_size=1, rank=0, local_rank=local_rank)


def _inputs(device: torch.device) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shapes = [(TOKENS, HIDDEN), (TOKENS, HIDDEN), (TOKENS, 4)]
    return [torch.randn(shape, generator=generator).to(device) for shape in shapes]


def _run(model: GatedMLP, input: torch.Tensor, output_weights: list[torch.Tensor]):
    input = input.clone().requires_grad_()
    output, routes = model(input)
    ((output * output_weights[0]).sum() + (routes * output_weights[1]).sum()).backward()
    return input, output, routes


# ---------------------------------------------------------------------------------------------------------------------
# One process


def test_single_process_linear_is_a_plain_affine_map():
    linear = Linear(
        "proj",
        LinearConfig(bias=BiasConfig(enabled=True, initialization=NormalInitializationConfig())),
        TensorDim("in", 5),
        TensorDim("out", 3),
        _single_process(),
        default_initialization=NormalInitializationConfig(),
    )
    input = torch.randn(4, 5)
    torch.testing.assert_close(linear(input), input @ linear.weight.T + linear.bias)


def test_forward_split_gives_the_split_output_and_its_gradients():
    model = GatedMLP(_single_process())
    input, output_weights = torch.randn(TOKENS, HIDDEN), torch.randn(TOKENS, 2 * INTERMEDIATE)
    results = []
    for split in (
        lambda x: model.gate_up(x).split(INTERMEDIATE, dim=-1),
        lambda x: model.gate_up.forward_split(x, INTERMEDIATE),
    ):
        model.zero_grad()
        leaf = input.clone().requires_grad_()
        parts = split(leaf)
        (torch.cat(parts, dim=-1) * output_weights).sum().backward()
        results.append((parts, leaf.grad, model.gate_up.weight.grad.clone(), model.gate_up.bias.grad.clone()))
    torch.testing.assert_close(results[1], results[0])


def test_flops_match_the_torch_counter():
    def count(linear, tokens):
        input = torch.randn(tokens, 5, requires_grad=True)
        with FlopCounterMode(display=False) as forward:
            output = linear(input)
        with FlopCounterMode(display=False) as backward:
            output.sum().backward()
        return forward.get_total_flops(), backward.get_total_flops()

    for lr_scale in (1.0, 0.0):
        linear = Linear(
            "proj",
            LinearConfig(lr_scale=lr_scale),
            TensorDim("in", 5),
            TensorDim("out", 3),
            _single_process(),
            default_initialization=NormalInitializationConfig(),
        )
        assert (linear.forward_flops(7), linear.backward_flops(7)) == count(linear, 7)


def test_single_process_has_no_process_group():
    with Distributed(DistributedConfig(), world_size=1, rank=0, local_rank=0) as distributed:
        assert not dist.is_initialized()
        assert distributed.tensor_group is None and distributed.tensor_rank == 0 and distributed.data_size == 1
        assert check_parallel_match(torch.tensor([1.0, float("nan")]), None, "alone") == 1


def test_world_size_the_layout_cannot_divide_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("RANK", "0")
    config = DistributedConfig(tensor_parallel=4)
    with pytest.raises(UsageError, match=r"cannot lay out 6 processes: world size 6 is not a multiple of .* = 4"):
        Distributed(config)
    assert not dist.is_initialized()


# ---------------------------------------------------------------------------------------------------------------------
# Several processes


def _check_layer_matches(distributed: Distributed, label: str) -> None:
    reference_model = GatedMLP(_single_process(distributed.backend, distributed.local_rank))
    input, *output_weights = _inputs(distributed.device)
    reference_input, reference_output, reference_routes = _run(reference_model, input, output_weights)

    model = GatedMLP(distributed)
    group, rank, size = distributed.tensor_group, distributed.tensor_rank, distributed.tensor_size
    # Under sequence-tensor-parallel each rank holds a chunk of the tokens, of the activations and of their gradients.
    own = (lambda tensor: tensor.chunk(size)[rank]) if distributed.sequence_tensor_parallel else (lambda tensor: tensor)
    local_input, output, routes = _run(model, own(input), [own(weights) for weights in output_weights])
    distributed.reduce_replicated_gradients(model.parameters())

    torch.testing.assert_close(output, own(reference_output), **TOLERANCE, msg=f"{label}: output")
    torch.testing.assert_close(routes, own(reference_routes), **TOLERANCE, msg=f"{label}: router output")
    torch.testing.assert_close(local_input.grad, own(reference_input.grad), **TOLERANCE, msg=f"{label}: input grad")
    for (name, parameter), reference in zip(model.named_parameters(), reference_model.parameters(), strict=True):
        meta = parameter.meta
        # Same initial weights as one process, and each shard is the matching slice of them.
        torch.testing.assert_close(
            parameter.detach(), meta.global_to_local(reference.detach(), rank, size), rtol=0, atol=0
        )
        torch.testing.assert_close(meta.local_to_global(parameter.detach(), group), reference.detach(), rtol=0, atol=0)
        global_grad = meta.local_to_global(parameter.grad, group)
        torch.testing.assert_close(global_grad, reference.grad, **TOLERANCE, msg=f"{label}: gradient of {name}")
        if not meta.tensor_parallel:
            assert check_parallel_match(parameter.grad, group, name, **TOLERANCE) == 0, f"{label}: {name}"
        expected_flag = distributed.sequence_tensor_parallel and name in ("down.bias", "router.weight", "router.bias")
        assert meta.reduce_gradient_over_tensor_group == expected_flag, f"{label}: {name}"

    # Per-component learning-rate scales follow the components' rows through the sharding.
    lr_scales = torch.cat([torch.full((INTERMEDIATE, 1), 1.0), torch.full((INTERMEDIATE, 1), 0.5)])
    torch.testing.assert_close(
        model.gate_up.weight.meta.lr_scale_rows(), model.gate_up_dim.global_to_local(lr_scales, 0, rank, size)
    )


def _check_mismatch_detection(distributed: Distributed) -> None:
    group = distributed.tensor_group
    tensor = torch.arange(10.0, device=distributed.device)
    assert check_parallel_match(tensor, group, "same") == 0
    if distributed.tensor_rank == 1:
        tensor[3] += 1e-3
        tensor[5] = float("nan")
    assert check_parallel_match(tensor, group, "close", atol=1e-2) == 1  # The NaN only.
    assert check_parallel_match(tensor, group, "planted") == 2
    with pytest.raises(
        ParallelMismatchError, match=rf"planted: 2 of 10 .*ranks \[{dist.get_process_group_ranks(group)[1]}\]"
    ):
        check_parallel_match(tensor, group, "planted", raise_on_mismatch=True)


def _tensor_parallel_cases(world_size: int, backend: str) -> None:
    logging.disable(logging.WARNING)  # The planted mismatches are logged on purpose.

    def layout(**parallel) -> Distributed:
        # The first one starts the process group; the later ones lay out its ranks differently.
        return Distributed(DistributedConfig(seed=SEED, backend=backend, timeout=60, **parallel))

    with layout(tensor_parallel=world_size) as distributed:
        rank = dist.get_rank()
        assert (distributed.rank, distributed.backend, dist.get_backend()) == (rank, backend, backend)
        assert (distributed.tensor_rank, distributed.tensor_size, distributed.data_size) == (rank, world_size, 1)
        _check_layer_matches(distributed, f"TP={world_size}")
        stp = layout(tensor_parallel=world_size, sequence_tensor_parallel=True)
        _check_layer_matches(stp, f"TP={world_size} with sequence-tensor-parallel")
        _check_mismatch_detection(distributed)
        odd = TensorDim("heads", 2 * world_size + 1, parallel=True)
        with pytest.raises(ValueError, match=rf"parameter 'odd': tensor dim 'heads' .* {world_size} tensor-parallel"):
            create_parameter("odd", (odd,), _settings(), distributed)
        if world_size == 4:
            # Tensor-parallel ranks vary fastest: ranks (0, 1) and (2, 3) form the tensor groups.
            mixed = layout(tensor_parallel=2, sequence_tensor_parallel=True)
            assert (mixed.tensor_rank, mixed.data_rank, mixed.data_size) == (rank % 2, rank // 2, 2)
            _check_layer_matches(mixed, "TP=2 × DP=2 with sequence-tensor-parallel")
    assert not dist.is_initialized()


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_matches_single_process(world_size):
    run_distributed(world_size, _tensor_parallel_cases, world_size, "gloo")


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_matches_single_process_on_gpus():
    run_distributed(2, _tensor_parallel_cases, 2, "nccl")
