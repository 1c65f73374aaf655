"""The first-party layers keep their tensor-parallel claims: under the debug mode (`blockzoo.distributed.debug`) a
model of attention (GQA and MQA), MLP, MoE, Mamba, Mamba 2 and discrete Mamba 2 blocks trains with tensor parallelism
(and sequence-tensor-parallel where every layer supports it) without a mismatch, and its losses and weights are bit
for bit those of the same run without the debug mode. Ranks whose plugin sets differ (one with
BLOCKZOO_DISABLE_PLUGINS=moe) refuse to start, naming the plugin.

Each run is driven directly (forward, backward, the tensor-group gradient sum, AdamW, the check after the step),
not through the Trainer. One spawn of two gloo ranks runs every case.
"""

import os

import pytest
import torch
import torch.distributed as dist
from transformer_reference import RANDOM_NORM, SEED, attention, block

from blockzoo.config import structure
from blockzoo.distributed import debug
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.consistency import check_ranks_agree
from blockzoo.distributed.data_parallel import prepare_micro_batch
from blockzoo.distributed.parallelize import parallelize
from blockzoo.distributed.runtime import Distributed, local_tensor
from blockzoo.errors import UsageError
from blockzoo.layers.base import Batch
from blockzoo.model.language_model import LanguageModel
from blockzoo.plugins import reset_registry
from blockzoo.run_config import RunConfig
from blockzoo_testing.distributed import run_distributed

VOCAB, TOKENS, STEPS = 64, 16, 2
LENGTHS = [5, 3, 8]
MLP = {"type": "mlp", "intermediate_size": 48, "gated": True}
MOE = {"type": "moe", "experts": 4, "experts_per_token": 2, "intermediate_size": 16, "z_loss_coefficient": 1e-3}

# Attention whose key/value heads TP 2 splits (GQA) and one it replicates inside the tensor region (MQA).
TRANSFORMER = {
    "type": "pattern",
    "pattern": ["gqa", "mqa"],
    "blocks": {
        "gqa": block({**attention(), "query_norm": RANDOM_NORM}),
        "mqa": block({**attention(heads=4, head_groups=1), "key_norm": RANDOM_NORM}),
    },
}
# Every first-party layer under TP 2 (MoE does not do sequence-tensor-parallel).
HYBRID = {
    "type": "pattern",
    "pattern": ["attention", "mamba", "mamba_2", "discrete"],
    "blocks": {
        "attention": {"mixer": attention(heads=4, head_groups=1), "mlp": MOE, "normalization": RANDOM_NORM},
        "mamba": {"mixer": {"type": "mamba", "state_size": 4, "inner_size": 32}, "mlp": MLP},
        "mamba_2": {
            "mixer": {"type": "mamba_2", "heads": 4, "head_size": 8, "state_size": 8, "groups": 2, "chunk_size": 4},
            "mlp": {"type": "none"},
        },
        "discrete": {
            "mixer": {
                "type": "discrete_mamba_2",
                "heads": 4,
                "groups": 2,
                "head_size": 8,
                "state_size": 8,
                "chunk_size": 4,
            },
            "mlp": MLP,
        },
    },
}


def _run_config(decoder: dict, **distributed) -> RunConfig:
    model = {
        "hidden_size": 32,
        "tied_embedding_weight": True,
        "embeddings": {"vocab_size": VOCAB},
        "decoder": decoder,
        "head": {"normalization": RANDOM_NORM},
    }
    data = {"model": model, "distributed": {"seed": SEED, "backend": "gloo", "timeout": 60} | distributed}
    return structure(data, RunConfig)


def _train(run_config: RunConfig, distributed: Distributed, with_debug: bool):
    model = parallelize(LanguageModel(run_config.model, distributed), run_config)  # ZeRO through FSDP2, if any
    hooks = debug.install(model, distributed) if with_debug else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses, device = [], distributed.device
    for step in range(1, STEPS + 1):
        generator = torch.Generator().manual_seed(step)
        tokens, labels = (torch.randint(0, VOCAB, (TOKENS,), generator=generator).to(device) for _ in range(2))
        prepare_micro_batch(model, distributed, last=True)
        cross_entropy, named = model.loss(tokens, labels, Batch(LENGTHS, device=device))
        (cross_entropy / TOKENS + sum(named.values())).backward()
        distributed.reduce_replicated_gradients(model.parameters())
        optimizer.step()
        if with_debug:
            debug.after_step(model, distributed, step)
        optimizer.zero_grad(set_to_none=True)
        losses.append([float(cross_entropy.detach()), *(float(value.detach()) for value in named.values())])
    weights = {name: local_tensor(parameter).detach().clone() for name, parameter in model.named_parameters()}
    return losses, weights, hooks


def _check_passes_unchanged(label: str, decoder: dict, **layout) -> None:
    run_config = _run_config(decoder, **layout)
    distributed = Distributed(run_config.distributed)
    losses, weights, _ = _train(run_config, distributed, with_debug=False)
    checked_losses, checked_weights, hooks = _train(run_config, distributed, with_debug=True)
    assert checked_losses == losses, label
    for name, weight in checked_weights.items():
        assert torch.equal(weight, weights[name]), f"{label}: {name}"
    tensor_parallel = distributed.tensor_size > 1
    assert (hooks.checked["forward"] > 0) == tensor_parallel, label
    assert (hooks.checked["backward"] > 0) == (tensor_parallel and not distributed.sequence_tensor_parallel), label


def _check_plugin_sets_must_agree(distributed: Distributed) -> None:
    run_config = _run_config(TRANSFORMER)
    if dist.get_rank() == 1:
        os.environ["BLOCKZOO_DISABLE_PLUGINS"] = "moe"
        reset_registry()
    with pytest.raises(UsageError) as raised:
        check_ranks_agree(run_config, distributed)
    message = str(raised.value)
    assert message.startswith("rank 1 does not run what rank 0 runs"), message
    assert "plugin 'moe': blockzoo-moe " in message and "(disabled: BLOCKZOO_DISABLE_PLUGINS) on rank 1" in message
    os.environ.pop("BLOCKZOO_DISABLE_PLUGINS", None)
    reset_registry()
    check_ranks_agree(run_config, distributed)


def _cases() -> None:
    with Distributed(DistributedConfig(seed=SEED, backend="gloo", timeout=60)) as world:
        _check_passes_unchanged("transformer tp2", TRANSFORMER, tensor_parallel=2)
        _check_passes_unchanged("transformer stp2", TRANSFORMER, tensor_parallel=2, sequence_tensor_parallel=True)
        _check_passes_unchanged("hybrid tp2", HYBRID, tensor_parallel=2)
        # FSDP2's DTensor parameters: replicated over the data ranks (ZeRO 0), sharded (ZeRO 3), and with TP 2.
        _check_passes_unchanged("transformer dp2 zero0", TRANSFORMER, zero_stage=0)
        _check_passes_unchanged("transformer dp2 zero3", TRANSFORMER, zero_stage=3)
        _check_passes_unchanged("transformer tp2 zero3", TRANSFORMER, tensor_parallel=2, zero_stage=3)
        _check_plugin_sets_must_agree(world)


@pytest.mark.distributed
def test_first_party_layers_pass_the_debug_mode_unchanged():
    run_distributed(2, _cases)


def _gpu_cases() -> None:
    """NCCL and the GPU kernels in bf16: no false alarm (the bf16 tolerance covers kernels that reorder sums), the
    replicated parameters stay bit-identical, and the results are those without the debug mode."""
    gpu = {"backend": "nccl", "compute_dtype": "bf16"}
    with Distributed(DistributedConfig(seed=SEED, timeout=60, **gpu)):
        _check_passes_unchanged("transformer tp2 bf16", TRANSFORMER, tensor_parallel=2, **gpu)
        _check_passes_unchanged("hybrid tp2 bf16", HYBRID, tensor_parallel=2, **gpu)


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_first_party_layers_pass_the_debug_mode_on_gpus():
    run_distributed(2, _gpu_cases)
