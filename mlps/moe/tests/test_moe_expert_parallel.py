"""Expert parallelism (experts split between 2 data-parallel ranks, all-to-all) against the runs without it.

One spawn of 2 gloo ranks checks: the layer on each rank's half of the tokens gives the single-process layer on all
of them (outputs, input gradients, every parameter's gradient reassembled to global); a short `Trainer` run with
expert parallelism gives the losses, gradient norms and final weights of the same data-parallel run without it; its
checkpoint loads into one process with the same logits, and the checkpoint without it loads into the expert-parallel
model; experts that do not divide between the ranks are refused. A second spawn (4 ranks) checks the layer with
tensor parallelism 2 on top.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import blockzoo
from blockzoo.checkpoint import latest_checkpoint, load_checkpoint
from blockzoo.config import ConfigFieldError, structure
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.runtime import Distributed
from blockzoo.errors import UsageError
from blockzoo.layers.base import Batch
from blockzoo.layers.config import MLPConfig
from blockzoo.layers.dims import TensorDim
from blockzoo.model.language_model import LanguageModel
from blockzoo.run_config import RunConfig
from blockzoo.training.trainer import Trainer
from blockzoo_moe.config import MoEMLPConfig
from blockzoo_moe.moe import MoEMLP
from blockzoo_testing import layer_inputs
from blockzoo_testing.distributed import run_distributed

HIDDEN, INTERMEDIATE, SEED = 16, 12, 4321
LENGTHS = [5, 7]  # Each rank's tokens; the single process sees both ranks' tokens.
TOLERANCE = {"atol": 1e-6, "rtol": 1e-5}  # fp32; the ranks sum in another order than the single process.
RANDOM_BIAS = {"bias": {"initialization": {"type": "normal", "std": 0.5}}}
SHARP_ROUTER = {"weight": {"initialization": {"type": "normal", "std": 1.0}}}
# Router losses off: their statistics are per rank, so they differ from the single process on all tokens.
BASE = {"type": "moe", "intermediate_size": INTERMEDIATE, "experts": 4, "experts_per_token": 2, "router": SHARP_ROUTER}
BASE |= {"auxiliary_loss_coefficient": 0.0, "expert_parallel": True}
LAYER_CONFIGS = {
    "gated, biases, gated shared experts": {
        **BASE,
        "add_linear_biases": True,
        **{name: RANDOM_BIAS for name in ("gate", "up", "down")},
        "shared_experts": 1,
        "shared_expert_gate": {},
        "shared_intermediate_size": INTERMEDIATE + 2,  # a shared MLP of its own width
    },
    "ungated, top-k then softmax": {**BASE, "gated": False, "routing": "top_k_softmax"},
    "sigmoid over groups": {**BASE, "routing": "sigmoid_top_k", "routing_groups": 2, "score_correction_bias": True},
}
EXPERT_PARAMETERS = {"gate_up.weight", "gate_up.bias", "down.weight", "down.bias"}

MOE_MODEL = {
    "hidden_size": HIDDEN,
    "tied_embedding_weight": False,
    "embeddings": {"vocab_size": 32},
    "decoder": {
        "type": "fixed",
        "num_blocks": 2,
        "block": {
            "mixer": {"type": "none"},
            "mlp": {
                "type": "moe",
                "experts": 4,
                "experts_per_token": 2,
                "intermediate_size": INTERMEDIATE,
                "add_linear_biases": True,
                "down": RANDOM_BIAS,
                "z_loss_coefficient": 0.01,
            },
        },
    },
}
STEPS = 3


def build_layer(config_data: dict, distributed: Distributed) -> MoEMLP:
    config = structure(config_data, MLPConfig)
    return MoEMLP(config, name="mlp", hidden_dim=TensorDim("hidden", HIDDEN), distributed=distributed, lr_scale=1.0)


def run_layer(model: MoEMLP, hidden: torch.Tensor, output_weights: torch.Tensor, lengths: list[int]):
    hidden = hidden.clone().requires_grad_()
    output = model(hidden, Batch(lengths))
    (output * output_weights).sum().backward()
    return output, hidden.grad


def both_ranks_inputs(distributed: Distributed, seed: int) -> tuple[torch.Tensor, torch.Tensor, slice]:
    """Hidden states and output weights of both data-parallel ranks' tokens, and where this rank's lie."""
    tokens = sum(LENGTHS)
    hidden, output_weights = layer_inputs(2 * tokens, HIDDEN, seed=seed)
    return hidden, output_weights, slice(distributed.data_rank * tokens, (distributed.data_rank + 1) * tokens)


def check_layer(distributed: Distributed) -> None:
    hidden, output_weights, mine = both_ranks_inputs(distributed, seed=0)
    single = Distributed(DistributedConfig(seed=SEED), world_size=1, rank=0, local_rank=0)
    for name, config_data in LAYER_CONFIGS.items():
        reference = build_layer(config_data, single)
        expected_output, expected_input_grad = run_layer(reference, hidden, output_weights, LENGTHS * 2)
        model = build_layer(config_data, distributed)
        output, input_grad = run_layer(model, hidden[mine], output_weights[mine], LENGTHS)

        torch.testing.assert_close(output, expected_output[mine], **TOLERANCE, msg=f"{name}: output")
        torch.testing.assert_close(input_grad, expected_input_grad[mine], **TOLERANCE, msg=f"{name}: input grad")
        named = dict(model.named_parameters())
        assert named.keys() == dict(reference.named_parameters()).keys()
        for parameter_name, expected in reference.named_parameters():
            parameter, meta = named[parameter_name], named[parameter_name].meta
            assert meta.data_parallel_sharded == (parameter_name in EXPERT_PARAMETERS), parameter_name
            if not parameter.requires_grad:  # frozen: the score correction bias
                assert torch.equal(parameter, expected) and parameter.grad is None, parameter_name
                continue
            if meta.data_parallel_sharded:
                assert parameter.shape[0] == expected.shape[0] // 2  # Each rank holds half of the experts.
                weight = meta.local_to_global(parameter.detach(), None, distributed.data_group)
                grad = meta.local_to_global(parameter.grad, None, distributed.data_group)
            else:  # Replicated: each rank's gradient is its tokens' part.
                weight, grad = parameter.detach(), parameter.grad.clone()
                dist.all_reduce(grad, group=distributed.data_group)
            assert torch.equal(weight, expected.detach()), f"{name}: {parameter_name} initialization"
            torch.testing.assert_close(grad, expected.grad, **TOLERANCE, msg=f"{name}: gradient of {parameter_name}")


def check_layer_with_tensor_parallel(distributed: Distributed) -> None:
    """Experts split both ways (tensor-parallel 2 over the intermediate dim, expert-parallel 2)."""
    hidden, output_weights, mine = both_ranks_inputs(distributed, seed=1)
    config_data = {**LAYER_CONFIGS["gated, biases, gated shared experts"], "down": {"bias": {"enabled": False}}}
    reference = build_layer(config_data, Distributed(DistributedConfig(seed=SEED), world_size=1, rank=0, local_rank=0))
    expected_output, expected_input_grad = run_layer(reference, hidden, output_weights, LENGTHS * 2)
    model = build_layer(config_data, distributed)
    output, input_grad = run_layer(model, hidden[mine], output_weights[mine], LENGTHS)
    distributed.reduce_replicated_gradients(model.parameters())
    torch.testing.assert_close(output, expected_output[mine], **TOLERANCE, msg="output")
    torch.testing.assert_close(input_grad, expected_input_grad[mine], **TOLERANCE, msg="input gradient")
    named = dict(model.named_parameters())
    for parameter_name, expected in reference.named_parameters():
        parameter, meta = named[parameter_name], named[parameter_name].meta
        data_group = distributed.data_group if meta.data_parallel_sharded else None
        weight = meta.local_to_global(parameter.detach(), distributed.tensor_group, data_group)
        grad = meta.local_to_global(parameter.grad, distributed.tensor_group, data_group).clone()
        if not meta.data_parallel_sharded:
            dist.all_reduce(grad, group=distributed.data_group)
        assert torch.equal(weight, expected.detach()), f"{parameter_name} initialization"
        torch.testing.assert_close(grad, expected.grad, **TOLERANCE, msg=f"gradient of {parameter_name}")


def tensor_and_expert_parallel_case() -> None:
    with Distributed(DistributedConfig(seed=SEED, backend="gloo", timeout=60, tensor_parallel=2)) as distributed:
        assert distributed.data_size == 2
        check_layer_with_tensor_parallel(distributed)


def check_indivisible_experts_refused(distributed: Distributed) -> None:
    with pytest.raises(UsageError, match=r"mlp\.experts: .*2 data-parallel ranks.*\(3\)"):
        build_layer({**BASE, "experts": 3}, distributed)


def run_config(output_dir: Path, expert_parallel: bool) -> RunConfig:
    model = {**MOE_MODEL, "decoder": {**MOE_MODEL["decoder"], "block": dict(MOE_MODEL["decoder"]["block"])}}
    model["decoder"]["block"]["mlp"] = {**MOE_MODEL["decoder"]["block"]["mlp"], "expert_parallel": expert_parallel}
    data = {
        "model": model,
        "distributed": {"seed": SEED, "backend": "gloo", "timeout": 60},
        "data": {"type": "random", "sequence_length": 16, "micro_batch_size": 2, "max_document_length": 9},
        "training": {
            "train_iters": STEPS,
            "gradient_clipping": 0.5,
            "optimizer": {"learning_rate": 0.01},
            "schedule": {"warmup_iters": 1},
            "evaluation": {"interval": None},
            "log_interval": 100,
            "output_dir": str(output_dir),
        },
    }
    return structure(data, RunConfig)


def global_weights(model: LanguageModel, distributed: Distributed) -> dict[str, torch.Tensor]:
    return {
        name: parameter.meta.local_to_global(parameter.detach(), distributed.tensor_group, distributed.data_group)
        for name, parameter in model.named_parameters()
    }


def train(output_dir: Path, expert_parallel: bool) -> Trainer:
    config = run_config(output_dir, expert_parallel)
    trainer = Trainer(config, distributed=Distributed(config.distributed), log=lambda _: None)
    trainer.run()
    return trainer


def check_training_and_checkpoints(root: Path) -> None:
    replicated = train(root / "replicated", expert_parallel=False)
    expert_parallel = train(root / "expert_parallel", expert_parallel=True)
    distributed = expert_parallel.distributed
    for record, expected in zip(expert_parallel.history, replicated.history, strict=True):
        torch.testing.assert_close(record.loss, expected.loss, rtol=1e-5, atol=0.0, msg=f"step {record.step}: loss")
        torch.testing.assert_close(record.gradient_norm, expected.gradient_norm, rtol=1e-5, atol=0.0)
        assert record.gradient_norm > 0.5  # Clipping acts, so the norm enters the update.
    weights = global_weights(expert_parallel.model, distributed)
    expected_weights = global_weights(replicated.model, replicated.distributed)
    assert weights.keys() == expected_weights.keys()
    for name, weight in weights.items():
        torch.testing.assert_close(weight, expected_weights[name], rtol=1e-5, atol=1e-5, msg=name)
    # The expert-parallel run's checkpoint in one process: its global weights, the same logits.
    loaded = blockzoo.load(expert_parallel.output_dir)
    assert loaded.distributed.world_size == 1
    for name, parameter in loaded.named_parameters():
        assert torch.equal(parameter.detach(), weights[name]), name
    input_ids = torch.randint(0, 32, (3, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids), expert_parallel.model(input_ids), atol=1e-5, rtol=1e-5)
    # The checkpoint without expert parallelism loads into the expert-parallel model: each rank takes its experts.
    model = LanguageModel(expert_parallel.run_config.model, distributed)
    load_checkpoint(latest_checkpoint(replicated.output_dir), model=model, distributed=distributed)
    for name, weight in global_weights(model, distributed).items():
        assert torch.equal(weight, expected_weights[name]), name


def expert_parallel_cases(root: str) -> None:
    with Distributed(DistributedConfig(seed=SEED, backend="gloo", timeout=60)) as distributed:
        assert distributed.data_size == 2
        check_layer(distributed)
        check_indivisible_experts_refused(distributed)
        check_training_and_checkpoints(Path(root))


@pytest.mark.distributed
def test_expert_parallel_matches_the_runs_without_it(tmp_path):
    run_distributed(2, expert_parallel_cases, str(tmp_path))


@pytest.mark.distributed
def test_tensor_and_expert_parallel_match_single_process():
    run_distributed(4, tensor_and_expert_parallel_case)


def test_expert_parallel_config_errors():
    config = MoEMLPConfig(experts=6, expert_parallel=True)
    config.check_expert_parallel(data_parallel=3, tensor_parallel=2)
    with pytest.raises(ConfigFieldError, match="experts"):
        config.check_expert_parallel(data_parallel=4, tensor_parallel=1)
    biased = MoEMLPConfig(experts=6, expert_parallel=True, add_linear_biases=True)
    biased.check_expert_parallel(data_parallel=2, tensor_parallel=1)
    with pytest.raises(ConfigFieldError, match=r"down\.bias"):
        biased.check_expert_parallel(data_parallel=2, tensor_parallel=2)
    MoEMLPConfig(experts=5).check_expert_parallel(data_parallel=2, tensor_parallel=1)  # Off: no constraint.
