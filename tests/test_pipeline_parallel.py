"""Pipeline parallelism (torch.distributed.pipelining, composed with tensor, sequence-tensor and data parallelism)
gives the single-process run.

The direct check drives the stages and the schedule without the trainer: each rank builds its stages of the model
(`build_pipeline_model`) and runs one step's micro-batches through `Pipeline.step`; the single-process model (built
in every rank from the same seed) runs the same micro-batches one after the other with the same loss weights. The
cross-entropy, every named loss (MoE router losses from both stages) and every parameter's gradient (the tied
weight's on both of its stages) must be those of the single process. One spawn per world size runs all of its
layouts.
"""

import pytest
import torch
from transformer_reference import RANDOM_NORM, SEED, VOCAB, attention, block, model_data, single_process

from blockzoo.config import structure
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.pipeline import Pipeline, PipelineMicroBatch, build_pipeline_model, local_stages
from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.base import IGNORE_INDEX, Batch
from blockzoo.model.language_model import LanguageModel
from blockzoo.run_config import RunConfig
from blockzoo.testing.distributed import run_distributed
from blockzoo.training.optimizer import unique_trainable

# fp32: the stages sum in the single process's order, but tensor and data parallelism reorder sums.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
# fp32 on a GPU against the CPU: other kernels (cuBLAS, SDPA, the Mamba 2 scans) sum in other orders.
GPU_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
TOKENS = 16  # per micro-batch (static shapes)

MOE = {
    "type": "moe",
    "experts": 4,
    "experts_per_token": 2,
    "intermediate_size": 24,
    "z_loss_coefficient": 0.01,
    "router": {"weight": {"initialization": {"type": "normal", "std": 1.0}}},
}
MAMBA_2 = {"type": "mamba_2", "heads": 2, "head_size": 8, "groups": 1, "state_size": 8, "chunk_size": 4}


def _pattern(num_blocks: int) -> dict:
    """Four named blocks (two attentions that differ in their rotary tables and window), repeated to num_blocks."""
    blocks = {
        "local": block(attention(theta=50.0, window=3)),
        "global": block(attention()),
        "wide": {**block(attention(heads=8, head_groups=4)), "mlp": {"type": "mlp", "intermediate_size": 40}},
        "narrow": block(attention(heads=2, head_groups=1)),
    }
    return {"type": "pattern", "pattern": list(blocks), "num_blocks": num_blocks, "blocks": blocks}


HYBRID_MOE = {
    "type": "pattern",
    "pattern": ["attn_moe", "ssm", "attn", "ssm_moe"],
    "blocks": {
        "attn_moe": {**block(attention()), "mlp": MOE},
        "ssm": {"mixer": MAMBA_2, "mlp": {"type": "none"}, "normalization": RANDOM_NORM},
        "attn": block(attention(window=4)),
        "ssm_moe": {"mixer": MAMBA_2, "mlp": MOE, "normalization": RANDOM_NORM},
    },
}
MODELS = {
    "pattern-4": model_data(tied=True, decoder=_pattern(4)),
    "pattern-6": model_data(tied=False, decoder=_pattern(6)),
    "hybrid-moe": model_data(tied=True, decoder=HYBRID_MOE),
}
INTERLEAVED = {"pipeline_schedule": "interleaved", "pipeline_stages_per_rank": 2}
# label -> (model, distributed settings, micro-batches per data rank)
LAYOUTS = {
    2: {
        "pp2 1f1b, split 3+1": ("pattern-4", {"pipeline_split": [3]}, 3),
        "pp2 interleaved, 4 stages of 2+1+2+1": ("pattern-6", {**INTERLEAVED, "pipeline_split": [2, 3, 5]}, 4),
        "pp2 hybrid moe, tied": ("hybrid-moe", {}, 2),
    },
    4: {
        "pp2 tp2": ("pattern-4", {"tensor_parallel": 2}, 2),
        "pp2 stp2 interleaved": (
            "pattern-4",
            {**INTERLEAVED, "tensor_parallel": 2, "sequence_tensor_parallel": True},
            2,
        ),
        "pp2 dp2 hybrid moe": ("hybrid-moe", {}, 2),
    },
}


def _micro_batches(count: int, seed: int) -> list[PipelineMicroBatch]:
    """Random packed micro-batches of TOKENS tokens: documents of 2 to 9 tokens, labels the next token of the
    document (IGNORE_INDEX at each document's end)."""
    generator = torch.Generator().manual_seed(seed)
    micro_batches = []
    for _ in range(count):
        lengths, left = [], TOKENS
        while left:
            lengths.append(min(left, int(torch.randint(2, 10, (), generator=generator))))
            left -= lengths[-1]
        tokens = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
        labels = torch.cat([tokens[1:], tokens[:1]])
        labels[torch.tensor(lengths).cumsum(0) - 1] = IGNORE_INDEX
        micro_batches.append(PipelineMicroBatch(tokens=tokens, labels=labels, batch=Batch(lengths)))
    return micro_batches


def _run_config(model: str, micro_batches: int = 1, **distributed) -> RunConfig:
    data = {
        "model": MODELS[model],
        "distributed": {"seed": SEED, "backend": "gloo", "timeout": 60, **distributed},
        "training": {"gradient_accumulation": micro_batches},
    }
    return structure(data, RunConfig)


def _single_process_step(model: str, micro_batches: list[PipelineMicroBatch]) -> dict:
    """The single-process model's step over all micro-batches: the trainer's loss (cross-entropy over the labelled
    tokens of the step, named losses averaged over the micro-batches), its gradients and figures."""
    model = LanguageModel(_run_config(model).model, single_process())
    labelled = sum(int((micro.labels != IGNORE_INDEX).sum()) for micro in micro_batches)
    cross_entropy, named = 0.0, []
    for micro in micro_batches:
        value, losses = model.loss(micro.tokens, micro.labels, Batch(micro.batch.lengths))
        (value / labelled + sum(losses.values()) / len(micro_batches)).backward()
        cross_entropy += float(value)
        named.append({name: float(loss) for name, loss in losses.items()})
    return {
        "cross_entropy": cross_entropy,
        "named": named,
        "labelled": labelled,
        "weights": {name: parameter.detach() for name, parameter in model.named_parameters()},
        "gradients": {name: parameter.grad for name, parameter in model.named_parameters()},
    }


def _reduce_gradients(model: LanguageModel, distributed: Distributed) -> None:
    """What the trainer does after the backward: partial gradients summed over the tensor group, then all over the
    data group."""
    parameters = unique_trainable(model.parameters())
    distributed.reduce_replicated_gradients(parameters)
    if distributed.data_group is not None:
        for parameter in parameters:
            torch.distributed.all_reduce(parameter.grad, group=distributed.data_group)


def _on(device: torch.device, micro: PipelineMicroBatch) -> PipelineMicroBatch:
    batch = Batch(micro.batch.lengths, device=device)
    return PipelineMicroBatch(tokens=micro.tokens.to(device), labels=micro.labels.to(device), batch=batch)


def _check_step(label: str, model: str, settings: dict, count: int, tolerance: dict = TOLERANCE) -> None:
    run_config = _run_config(model, count, pipeline_parallel=2, **settings)
    distributed = Distributed(run_config.distributed)
    data_size, data_rank = distributed.data_size, distributed.data_rank
    everything = _micro_batches(count * data_size, seed=len(label))
    reference = _single_process_step(model, everything)  # on the CPU
    own = [_on(distributed.device, micro) for micro in everything[data_rank * count : (data_rank + 1) * count]]

    pipelined = build_pipeline_model(run_config.model, distributed)
    pipeline = Pipeline(pipelined, distributed)
    losses = pipeline.step(
        own, cross_entropy_weight=1.0 / reference["labelled"], named_loss_weight=1.0 / len(everything)
    )
    _reduce_gradients(pipelined, distributed)

    # Only this rank's stages are allocated: their blocks, the embeddings on the first, the head on the last.
    stages = local_stages(distributed)
    blocks = {index for stage in stages for index in pipeline.stage_blocks[stage]}
    expected = {name for name in reference["weights"] if not name.startswith("decoder.")}
    last = pipeline.num_stages - 1
    expected = {
        name for name in expected if ("embeddings" in name and 0 in stages) or ("head" in name and last in stages)
    }
    expected |= {
        name for name in reference["weights"] if name.startswith("decoder.") and int(name.split(".")[1]) in blocks
    }
    expected |= pipeline.copies
    names = {name for name, _ in pipelined.named_parameters()}
    assert names == expected, f"{label}: rank {distributed.rank} holds {sorted(names ^ expected)} wrongly"

    cross_entropy = losses.cross_entropy.clone()
    if distributed.sequence_tensor_parallel:  # each tensor rank's loss covers its own tokens
        torch.distributed.all_reduce(cross_entropy, group=distributed.tensor_group)
    if distributed.data_group is not None:
        torch.distributed.all_reduce(cross_entropy, group=distributed.data_group)
    torch.testing.assert_close(float(cross_entropy), reference["cross_entropy"], **tolerance, msg=f"{label}: loss")
    named = reference["named"][data_rank * count : (data_rank + 1) * count]
    expected_named = {name: sum(values[name] for values in named) for name in named[0]}
    assert losses.named.keys() == expected_named.keys(), f"{label}: named losses {sorted(losses.named)}"
    for name, value in losses.named.items():
        torch.testing.assert_close(float(value), expected_named[name], **tolerance, msg=f"{label}: {name}")

    groups = (distributed.tensor_group, distributed.data_group)
    for name, parameter in pipelined.named_parameters():
        weight = parameter.meta.local_to_global(parameter.detach(), *groups).cpu()
        assert torch.equal(weight, reference["weights"][name]), f"{label}: initial {name}"
        gradient = parameter.meta.local_to_global(parameter.grad, *groups).cpu()
        torch.testing.assert_close(gradient, reference["gradients"][name], **tolerance, msg=f"{label}: grad of {name}")
    distributed.shutdown()


def _check_layouts(world_size: int) -> None:
    with Distributed(DistributedConfig(seed=SEED, backend="gloo", timeout=60)):
        for label, (model, settings, count) in LAYOUTS[world_size].items():
            _check_step(label, model, settings, count)
            torch.distributed.barrier()


def _check_on_gpus() -> None:
    nccl = {"backend": "nccl"}
    with Distributed(DistributedConfig(seed=SEED, timeout=120, **nccl)):
        for label, (model, settings, count) in LAYOUTS[2].items():
            _check_step(f"{label} (cuda)", model, {**settings, **nccl}, count, tolerance=GPU_TOLERANCE)
            torch.distributed.barrier()


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", LAYOUTS)
def test_pipeline_step_matches_single_process(world_size):
    run_distributed(world_size, _check_layouts, world_size)


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_pipeline_step_on_two_gpus_matches_single_process():
    """The world-2 layouts on two GPUs (NCCL, fp32): the installed torch's pipelining with real devices."""
    run_distributed(2, _check_on_gpus)
