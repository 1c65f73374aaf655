"""Every parallel layout the dense MLP declares gives the single-process outputs and gradients (gloo on CPU).

One set of processes per world size runs every layout in it (a spawn costs seconds); each rank builds the
single-process reference itself, from the same seed.
"""

import pytest
import torch
import torch.distributed as dist

from blockzoo.config import structure
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.base import Batch
from blockzoo.layers.config import MLPConfig
from blockzoo.layers.dims import TensorDim
from blockzoo_mlp.mlp import DenseMLP
from blockzoo_testing.distributed import run_distributed

HIDDEN, INTERMEDIATE, LENGTHS, SEED = 16, 24, [3, 5], 4321
TOLERANCE = {"atol": 1e-6, "rtol": 1e-5}  # fp32; the ranks sum in another order than the single process.
RANDOM_BIAS = {"bias": {"initialization": {"type": "normal", "std": 0.5}}}
CONFIGS = {
    "gated, biases, per-component settings": {
        "intermediate_size": INTERMEDIATE,
        "gated": True,
        "add_linear_biases": True,
        "gate": {**RANDOM_BIAS, "lr_scale": 0.5},
        "up": {"weight": {"initialization": {"type": "uniform", "low": -0.3, "high": 0.3}}, **RANDOM_BIAS},
        "down": RANDOM_BIAS,
    },
    "ungated squared relu": {"intermediate_size": INTERMEDIATE, "activation": "squared_relu"},
}


def build(config_data: dict, distributed: Distributed) -> DenseMLP:
    config = structure(config_data, MLPConfig)
    return DenseMLP(config, name="mlp", hidden_dim=TensorDim("hidden", HIDDEN), distributed=distributed, lr_scale=1.0)


def check_layout(distributed: Distributed, label: str) -> None:
    generator = torch.Generator().manual_seed(0)
    tokens = sum(LENGTHS)
    hidden, output_weights = (
        torch.randn(tokens, HIDDEN, generator=generator),
        torch.randn(tokens, HIDDEN, generator=generator),
    )
    tensor_rank, tensor_size = distributed.tensor_rank, distributed.tensor_size

    def own(tensor: torch.Tensor) -> torch.Tensor:
        """This rank's tokens: split between data ranks (as sequence-data-parallel would split a sequence; each token
        is transformed on its own), then between tensor ranks under sequence-tensor-parallel."""
        tensor = tensor.chunk(distributed.data_size)[distributed.data_rank]
        return tensor.chunk(tensor_size)[tensor_rank] if distributed.sequence_tensor_parallel else tensor

    single = Distributed(DistributedConfig(seed=SEED), world_size=1, rank=0, local_rank=0)
    for name, config_data in CONFIGS.items():
        reference = build(config_data, single)
        reference_input = hidden.clone().requires_grad_()
        reference_output = reference(reference_input, Batch(LENGTHS))
        (reference_output * output_weights).sum().backward()

        model = build(config_data, distributed)
        local_input = own(hidden).clone().requires_grad_()
        output = model(local_input, Batch(LENGTHS))
        (output * own(output_weights)).sum().backward()
        distributed.reduce_replicated_gradients(model.parameters())
        if distributed.data_size > 1:  # The trainer's job: sum the gradients of the token splits.
            for parameter in model.parameters():
                dist.all_reduce(parameter.grad, group=distributed.data_group)

        where = f"{label}, {name}"
        torch.testing.assert_close(output, own(reference_output), **TOLERANCE, msg=f"{where}: output")
        torch.testing.assert_close(local_input.grad, own(reference_input.grad), **TOLERANCE, msg=f"{where}: input")
        for (parameter_name, parameter), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
            meta = parameter.meta
            # The same initial weights as one process: each shard is the matching slice of them.
            assert torch.equal(parameter, meta.global_to_local(expected, tensor_rank, tensor_size)), parameter_name
            torch.testing.assert_close(
                meta.local_to_global(parameter.grad, distributed.tensor_group),
                expected.grad,
                **TOLERANCE,
                msg=f"{where}: gradient of {parameter_name}",
            )


def parallel_cases(world_size: int) -> None:
    def layout(**parallel) -> Distributed:
        # The first one starts the process group; the later ones lay out its ranks differently.
        return Distributed(DistributedConfig(seed=SEED, backend="gloo", timeout=60, **parallel))

    with layout(tensor_parallel=world_size) as distributed:
        check_layout(distributed, f"TP={world_size}")
        check_layout(layout(tensor_parallel=world_size, sequence_tensor_parallel=True), f"STP={world_size}")
        if world_size == 4:
            mixed = layout(tensor_parallel=2, sequence_tensor_parallel=True)
            check_layout(mixed, "STP=2 × DP=2")
        odd = {"intermediate_size": 2 * world_size + 1}
        with pytest.raises(ValueError, match=rf"'mlp.up.weight': tensor dim 'up' of size {2 * world_size + 1}"):
            build(odd, distributed)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_parallel_layouts_match_single_process(world_size):
    run_distributed(world_size, parallel_cases, world_size)
