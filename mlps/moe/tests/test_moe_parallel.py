"""Tensor-parallel experts give the single-process outputs, router losses and gradients (gloo on CPU, one spawn).

Each rank builds the single-process reference itself, from the same seed.
"""

import pytest
import torch

from blockzoo.config import structure
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.base import Batch
from blockzoo.layers.config import MLPConfig
from blockzoo.layers.dims import TensorDim
from blockzoo_moe.moe import MoEMLP
from blockzoo_testing.distributed import run_distributed

HIDDEN, INTERMEDIATE, LENGTHS, SEED = 16, 12, [5, 7], 4321
TOLERANCE = {"atol": 1e-6, "rtol": 1e-5}  # fp32; the ranks sum in another order than the single process.
RANDOM_BIAS = {"bias": {"initialization": {"type": "normal", "std": 0.5}}}
BASE = {"type": "moe", "intermediate_size": INTERMEDIATE, "experts": 4, "experts_per_token": 2}
CONFIGS = {
    "gated, biases, gated shared experts, losses": {
        **BASE,
        "add_linear_biases": True,
        "gate": {**RANDOM_BIAS, "lr_scale": 0.5},
        "up": RANDOM_BIAS,
        "down": RANDOM_BIAS,
        "shared_experts": 2,
        "shared_expert_gate": {},
        "router": {"weight": {"initialization": {"type": "normal", "std": 1.0}}},
        "auxiliary_loss_coefficient": 0.1,
        "z_loss_coefficient": 0.05,
    },
    "ungated, top-k then softmax": {
        **BASE,
        "gated": False,
        "routing": "top_k_softmax",
    },
    "softmax top-k without renormalization, one shared expert of its own width": {
        **BASE,
        "norm_topk_prob": False,
        "shared_experts": 1,
        "shared_intermediate_size": 10,  # no multiple of the experts' 12; split 5 + 5 over two ranks
    },
    "sigmoid over groups, scaled, one shared expert": {
        **BASE,
        "routing": "sigmoid_top_k",
        "routing_groups": 2,
        "routed_scale": 2.0,
        "score_correction_bias": True,
        "shared_experts": 1,
    },
}


def build(config_data: dict, distributed: Distributed) -> MoEMLP:
    config = structure(config_data, MLPConfig)
    return MoEMLP(config, name="mlp", hidden_dim=TensorDim("hidden", HIDDEN), distributed=distributed, lr_scale=1.0)


def run(model: MoEMLP, hidden: torch.Tensor, output_weights: torch.Tensor):
    """Output, input gradient and losses of the objective (output · weights) + the layer's named losses."""
    hidden = hidden.clone().requires_grad_()
    batch = Batch(LENGTHS)
    output = model(hidden, batch)
    ((output * output_weights).sum() + sum(batch.losses.values())).backward()
    return output, hidden.grad, {name: loss.detach() for name, loss in batch.losses.items()}


def tensor_parallel_case() -> None:
    generator = torch.Generator().manual_seed(0)
    tokens = sum(LENGTHS)
    hidden = torch.randn(tokens, HIDDEN, generator=generator)
    output_weights = torch.randn(tokens, HIDDEN, generator=generator)
    single = Distributed(DistributedConfig(seed=SEED), world_size=1, rank=0, local_rank=0)
    with Distributed(DistributedConfig(seed=SEED, backend="gloo", timeout=60, tensor_parallel=2)) as distributed:
        for name, config_data in CONFIGS.items():
            reference = build(config_data, single)
            expected_output, expected_input_grad, expected_losses = run(reference, hidden, output_weights)
            model = build(config_data, distributed)
            output, input_grad, losses = run(model, hidden, output_weights)
            distributed.reduce_replicated_gradients(model.parameters())

            torch.testing.assert_close(output, expected_output, **TOLERANCE, msg=f"{name}: output")
            torch.testing.assert_close(input_grad, expected_input_grad, **TOLERANCE, msg=f"{name}: input gradient")
            assert losses.keys() == expected_losses.keys()
            for loss_name, value in losses.items():
                torch.testing.assert_close(value, expected_losses[loss_name], **TOLERANCE, msg=loss_name)
            named = dict(model.named_parameters())
            assert named.keys() == dict(reference.named_parameters()).keys()
            for parameter_name, expected in reference.named_parameters():
                parameter, meta = named[parameter_name], named[parameter_name].meta
                rank = distributed.tensor_rank
                assert torch.equal(parameter, meta.global_to_local(expected, rank, 2)), parameter_name
                if parameter_name in ("gate_up.weight", "down.weight"):
                    assert parameter.shape[0] == expected.shape[0] // 2  # Each rank holds half of every expert.
                torch.testing.assert_close(
                    meta.local_to_global(parameter.grad, distributed.tensor_group),
                    expected.grad,
                    **TOLERANCE,
                    msg=f"{name}: gradient of {parameter_name}",
                )


@pytest.mark.distributed
def test_tensor_parallel_matches_single_process():
    run_distributed(2, tensor_parallel_case)
