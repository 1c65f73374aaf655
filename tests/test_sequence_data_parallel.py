"""Sequence-data parallelism and micro-sequences give the single-process run: the losses, named losses, gradient norms
and every gradient of the same steps, and the weights after them.

Micro-sequences alone run in this process: a micro-batch's loss and every gradient, whole and in chunks, for each
model. The parallel layouts run the `Trainer` on gloo (one spawn per world size running all of its layouts) against
the single-process run of the same model trained in the test process (same seed and samples; the reference of a
layout with data-parallel ranks accumulates as many micro-batches per step as there are). Compared: each step's
loss, gradient norm and named losses, the last step's gradients and the final weights, all reassembled to global
tensors. The data (random documents of 2 to 9 tokens packed into sequences of 16, two sequences a micro-batch: 32
tokens) puts documents across every slice boundary and documents shorter than a slice in every layout.

The models are in `MODELS` and the layouts in `LAYOUTS` (label -> model, distributed settings): a new mixer joins by
adding a model (a hybrid `pattern` with it) and the layouts that run it; `MICRO_SEQUENCE_MODELS` lists the models the
one-process micro-sequence test runs.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformer_reference import RANDOM_NORM, SEED, attention, block, model_data, run_data, single_process

import blockzoo
from blockzoo.config import structure
from blockzoo.data.dataset import build_dataset
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.parallelize import parallelize
from blockzoo.distributed.runtime import Distributed
from blockzoo.model.language_model import LanguageModel
from blockzoo.run_config import RunConfig
from blockzoo.training.step import place_micro_batch
from blockzoo.training.trainer import Trainer
from blockzoo_testing.distributed import run_distributed

# fp32: the ranks sum in another order than the single process. 3 AdamW steps of lr 0.01 clipped at norm 1 (as in
# test_zero.py: Adam turns rounding of a gradient near its epsilon into update differences, hence the weights' atol:
# 5% of one step; one element of 1536 came out 2.6e-4 apart on one machine's CPU kernels, a wrong gradient moves
# whole rows by the step's size).
LOSS_TOLERANCE = {"rtol": 2e-5, "atol": 1e-7}
GRADIENT_TOLERANCE = {"rtol": 1e-4, "atol": 1e-6}
WEIGHT_TOLERANCE = {"rtol": 2e-5, "atol": 5e-4}
# The last step's gradients, taken at weights as far apart as WEIGHT_TOLERANCE allows (an element of 2e-3 came out
# 2.2e-6 apart on that machine).
TRAINED_GRADIENT_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
STEPS = 3

MOE = {
    "type": "moe",
    "experts": 4,
    "experts_per_token": 2,
    "intermediate_size": 24,
    "shared_experts": 1,
    "auxiliary_loss_coefficient": 0.1,  # its statistics cover the whole micro-batch in every layout
    "z_loss_coefficient": 0.01,
    # Well-separated router scores: a near tie could choose another expert in a layout whose matmuls round otherwise
    # (the ranks' processes and the reference's run with other thread counts), which no tolerance covers.
    "router": {"weight": {"initialization": {"type": "normal", "std": 1.0}}},
}


def _pattern(blocks: dict, pattern: list[str], num_blocks: int | None = None, tied: bool = True) -> dict:
    decoder = {"type": "pattern", "num_blocks": num_blocks or len(pattern), "pattern": pattern, "blocks": blocks}
    return model_data(tied=tied, decoder=decoder)


MODELS = {
    # GQA (two groups), a windowed MQA block with a per-head key norm, random norms and a tied head.
    "attention": _pattern(
        {
            "global": block({**attention(), "add_linear_biases": True, "query_norm": RANDOM_NORM}),
            "local": block({**attention(heads=4, head_groups=1, window=5), "key_norm": RANDOM_NORM}),
        },
        ["global", "local"],
    ),
    # Attention then MoE: the router losses are named losses of the whole micro-batch.
    "moe": _pattern(
        {"attn": block(attention()), "moe": {"mixer": attention(window=3), "mlp": MOE}},
        ["attn", "moe"],
        tied=False,
    ),
    # The example third-party plugin's convolution (a halo of kernel_size - 1 = 3 tokens) and attention.
    "shortconv": _pattern(
        {
            "conv": block({"type": "shortconv.gated_conv", "channels": 32, "kernel_size": 4}),
            "attn": block(attention()),
        },
        ["conv", "attn"],
    ),
}
# The three Mamba mixers and attention in one pattern (the SSM states and convolution inputs carried across slices).
MODELS["mamba"] = _pattern(
    {
        "mamba": block({"type": "mamba", "state_size": 4, "convolution": {"kernel_size": 4}}),
        "mamba_2": block({"type": "mamba_2", "heads": 4, "head_size": 8, "state_size": 4, "groups": 2}),
        "discrete": block(
            {"type": "discrete_mamba_2", "heads": 4, "groups": 2, "head_size": 8, "state_size": 4, "chunk_size": 3}
        ),
        "attn": block(attention()),
    },
    ["mamba", "mamba_2", "discrete", "attn"],
)
# Experts split over the data ranks (expert parallelism): each holds the tokens of its sequence-data rank's slices, its
# gradient summed over the group. The load-balancing statistics are per micro-batch, whose samples a data-parallel
# layout groups otherwise than the single process: left out here (the z loss, a mean of equal-sized micro-batches, is
# kept).
MODELS["moe-expert-parallel"] = _pattern(
    {"attn": block(attention()), "moe": {"mixer": attention(), "mlp": {**MOE, "auxiliary_loss_coefficient": 0.0}}},
    ["attn", "moe"],
)
MODELS["moe-expert-parallel"]["decoder"]["blocks"]["moe"]["mlp"]["expert_parallel"] = True
MICRO_SEQUENCE_MODELS = [name for name in MODELS if name != "moe-expert-parallel"]
DATA = {"type": "random", "sequence_length": 16, "micro_batch_size": 2, "min_document_length": 2}
DATA |= {"max_document_length": 9}

# label -> (model, distributed settings); the data-parallel size is what the world leaves.
LAYOUTS = {
    2: {
        "sdp2": ("attention", {"sequence_data_parallel": 2}),
        "sdp2-micro4": ("attention", {"sequence_data_parallel": 2, "micro_sequence_length": 4}),
        "sdp2-moe-zero1": ("moe", {"sequence_data_parallel": 2, "zero_stage": 1}),
        "sdp2-shortconv-micro8-zero3": (
            "shortconv",
            {"sequence_data_parallel": 2, "micro_sequence_length": 8, "zero_stage": 3},
        ),
        "sdp2-mamba-micro4": ("mamba", {"sequence_data_parallel": 2, "micro_sequence_length": 4}),
        "sdp2-moe-micro8-recompute": (
            "moe",
            {"sequence_data_parallel": 2, "micro_sequence_length": 8, "training.recompute": "selective"},
        ),
    },
    4: {
        "sdp4": ("attention", {"sequence_data_parallel": 4}),
        "sdp4-moe-micro4": ("moe", {"sequence_data_parallel": 4, "micro_sequence_length": 4}),
        "sdp2-tp2": ("attention", {"sequence_data_parallel": 2, "tensor_parallel": 2}),
        "sdp2-stp2-micro4-shortconv": (
            "shortconv",
            {"sequence_data_parallel": 2, "tensor_parallel": 2, "sequence_tensor_parallel": True}
            | {"micro_sequence_length": 4},
        ),
        "sdp2-dp2-zero3-shortconv": ("shortconv", {"sequence_data_parallel": 2, "zero_stage": 3}),
        "sdp2-pp2-moe": ("moe", {"sequence_data_parallel": 2, "pipeline_parallel": 2}),
        "sdp2-dp2-moe-expert-parallel": ("moe-expert-parallel", {"sequence_data_parallel": 2}),
        "sdp4-mamba": ("mamba", {"sequence_data_parallel": 4}),
        "sdp2-stp2-micro4-mamba": (
            "mamba",
            {"sequence_data_parallel": 2, "tensor_parallel": 2, "sequence_tensor_parallel": True}
            | {"micro_sequence_length": 4},
        ),
    },
}


CHECKPOINT_LAYOUT = "sdp2-shortconv-micro8-zero3"


def _run_config(model: str, output_dir: Path, accumulation: int, **distributed) -> RunConfig:
    """The run; a setting named `training.<field>` is a training field (the others distributed ones)."""
    training = {
        "train_iters": STEPS,
        "gradient_accumulation": accumulation,
        "optimizer": {"learning_rate": 0.01},
        "schedule": {"warmup_iters": 1},
        "log_interval": 100,
        "output_dir": str(output_dir),
    }
    for name in [name for name in distributed if name.startswith("training.")]:
        training[name.removeprefix("training.")] = distributed.pop(name)
    data = run_data(MODELS[model], data=DATA, training=training)
    data["distributed"].update(timeout=120, **distributed)
    return structure(data, RunConfig)


def _data_size(world_size: int, settings: dict) -> int:
    other = settings.get("tensor_parallel", 1) * settings["sequence_data_parallel"]
    return world_size // (other * settings.get("pipeline_parallel", 1))


def _accumulation(world_size: int, settings: dict) -> int:
    """Micro-batches per step and data rank: a pipeline needs as many as its stages."""
    return settings.get("pipeline_parallel", 1)


def _history(trainer: Trainer) -> list[dict]:
    return [{"loss": r.loss, "norm": r.gradient_norm, "losses": r.losses} for r in trainer.history]


def _global(tensor: torch.Tensor, parameter, distributed: Distributed) -> torch.Tensor:
    """The global tensor of a parameter-shaped tensor of any layout (a collective of every rank)."""
    return parameter.meta.local_to_global(tensor.detach(), distributed.tensor_group, distributed.data_group)


def _assert_same_history(history: list[dict], reference: list[dict], label: str) -> None:
    assert len(history) == len(reference), label
    for step, (record, expected) in enumerate(zip(history, reference), start=1):
        message = f"{label}, step {step}"
        torch.testing.assert_close(record["loss"], expected["loss"], **LOSS_TOLERANCE, msg=f"{message}: loss")
        torch.testing.assert_close(record["norm"], expected["norm"], **LOSS_TOLERANCE, msg=f"{message}: grad norm")
        assert record["losses"].keys() == expected["losses"].keys(), message
        for name, value in record["losses"].items():
            torch.testing.assert_close(value, expected["losses"][name], **LOSS_TOLERANCE, msg=f"{message}: {name}")


# ---------------------------------------------------------------------------------------------------------------------
# Micro-sequences in one process


def _loss_and_gradients(model: LanguageModel, micro, distributed: Distributed) -> tuple[dict, dict]:
    placed = place_micro_batch(micro, distributed)
    model.zero_grad(set_to_none=True)
    cross_entropy, losses = model.loss(placed.tokens, placed.labels, placed.batch)
    (cross_entropy / placed.labelled() + sum(losses.values())).backward()  # the trainer's objective
    figures = {"cross_entropy": cross_entropy.detach(), **{name: value.detach() for name, value in losses.items()}}
    return figures, {name: parameter.grad.clone() for name, parameter in model.named_parameters()}


@pytest.mark.parametrize("model", MICRO_SEQUENCE_MODELS)
@pytest.mark.parametrize("micro_sequence_length", [4, 8])
def test_micro_sequences_give_the_whole_sequence_step(model, micro_sequence_length):
    run_config = _run_config(model, Path("unused"), 1)
    whole = single_process(run_config.distributed)
    chunked = single_process(DistributedConfig(seed=SEED, backend="gloo", micro_sequence_length=micro_sequence_length))
    network = LanguageModel(run_config.model, whole)
    dataset = build_dataset(run_config.data, seed=SEED, model_vocab_size=run_config.model.embeddings.vocab_size)
    micro = next(dataset.training_batches())
    expected_figures, expected_grads = _loss_and_gradients(network, micro, whole)
    # The same model: the layout decides only how the micro-batch is placed (whole, or this process's chunks).
    figures, grads = _loss_and_gradients(network, micro, chunked)
    assert figures.keys() == expected_figures.keys()
    for name, value in figures.items():
        torch.testing.assert_close(value, expected_figures[name], **LOSS_TOLERANCE, msg=name)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], **GRADIENT_TOLERANCE, msg=name)
        assert expected_grads[name].abs().max() > 0, name  # every weight took part


@pytest.mark.parametrize("model", MICRO_SEQUENCE_MODELS)
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputed_micro_sequences_give_the_whole_sequence_step(model, recompute):
    """Recomputing the blocks' forward_slice (its carry too) changes nothing; the named losses are added once."""
    run_config = _run_config(model, Path("unused"), 1, **{"training.recompute": recompute})
    whole = single_process(run_config.distributed)
    chunked = single_process(DistributedConfig(seed=SEED, backend="gloo", micro_sequence_length=4))
    plain, recomputed = LanguageModel(run_config.model, whole), LanguageModel(run_config.model, chunked)
    parallelize(recomputed, run_config)
    dataset = build_dataset(run_config.data, seed=SEED, model_vocab_size=run_config.model.embeddings.vocab_size)
    micro = next(dataset.training_batches())
    expected_figures, expected_grads = _loss_and_gradients(plain, micro, whole)
    figures, grads = _loss_and_gradients(recomputed, micro, chunked)
    assert figures.keys() == expected_figures.keys()
    for name, value in figures.items():
        torch.testing.assert_close(value, expected_figures[name], **LOSS_TOLERANCE, msg=name)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], **GRADIENT_TOLERANCE, msg=name)


# ---------------------------------------------------------------------------------------------------------------------
# In the spawned ranks


def _check_checkpoint_loads_in_one_process(trainer: Trainer) -> None:
    """The run's last checkpoint (written from FSDP shards over data × sequence_data) loads into one process: the
    global weights exactly."""
    loaded = blockzoo.load(trainer.output_dir)
    assert loaded.distributed.world_size == 1
    for name, parameter in trainer.model.named_parameters():
        weight = _global(parameter, parameter, trainer.distributed)
        assert torch.equal(dict(loaded.named_parameters())[name].detach(), weight), name


def _check_layout(label: str, model: str, settings: dict, root: Path, reference: dict) -> None:
    run_config = _run_config(model, root / label, reference["accumulation"], **settings)
    trainer = Trainer(run_config, distributed=Distributed(run_config.distributed), log=lambda _: None)
    trainer.run()
    _assert_same_history(_history(trainer), reference["history"], label)
    distributed = trainer.distributed
    for name, parameter in trainer.model.named_parameters():
        gradient = _global(parameter.grad, parameter, distributed)  # the last step's, clipped as the reference's
        message = f"{label}: {name}"
        torch.testing.assert_close(gradient, reference["gradients"][name], **TRAINED_GRADIENT_TOLERANCE, msg=message)
        weight = _global(parameter, parameter, distributed)
        torch.testing.assert_close(weight, reference["weights"][name], **WEIGHT_TOLERANCE, msg=message)
        assert (weight - reference["initial"][name]).abs().max() > 1e-3, f"{message} did not train"
    if label == CHECKPOINT_LAYOUT:
        _check_checkpoint_loads_in_one_process(trainer)
    trainer.close()


def _check_layouts(world_size: int, references: dict, root: str) -> None:
    with Distributed(DistributedConfig(seed=SEED, backend="gloo", timeout=120)):
        for label, (model, settings) in LAYOUTS[world_size].items():
            _check_layout(label, model, settings, Path(root), references[label])
            dist.barrier()


# ---------------------------------------------------------------------------------------------------------------------
# In the test process


def _references(world_size: int, root: Path) -> dict:
    runs: dict[tuple[str, int], dict] = {}
    references = {}
    for label, (model, settings) in LAYOUTS[world_size].items():
        accumulation = _accumulation(world_size, settings)
        key = (model, accumulation * _data_size(world_size, settings))
        if key not in runs:
            trainer = Trainer(_run_config(model, root / f"single-{model}-{key[1]}", key[1]), log=lambda _: None)
            trainer.run()
            fresh = LanguageModel(trainer.run_config.model, single_process())
            runs[key] = {
                "history": _history(trainer),
                "gradients": {name: parameter.grad.clone() for name, parameter in trainer.model.named_parameters()},
                "weights": {name: parameter.detach() for name, parameter in trainer.model.named_parameters()},
                "initial": {name: parameter.detach() for name, parameter in fresh.named_parameters()},
            }
        references[label] = {**runs[key], "accumulation": accumulation}
    return references


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", LAYOUTS)
def test_sequence_data_parallel_matches_the_single_process_run(world_size, tmp_path):
    references = _references(world_size, tmp_path)
    run_distributed(world_size, _check_layouts, world_size, references, str(tmp_path))


# ---------------------------------------------------------------------------------------------------------------------
# On two GPUs

# bf16 compute on CUDA (the GPU kernels: varlen attention, the Triton convolution and scans); the layouts sum in
# other orders than one GPU, at bf16's resolution.
GPU_TOLERANCE = {"rtol": 2e-2, "atol": 1e-3}
GPU_LAYOUTS = {
    "sdp2": {"sequence_data_parallel": 2},
    "sdp2-micro8": {"sequence_data_parallel": 2, "micro_sequence_length": 8},
}
GPU_MODELS = ["attention", "shortconv", *(["mamba"] if "mamba" in MODELS else [])]


def _gpu_settings(**settings) -> dict:
    return {"backend": "nccl", "compute_dtype": "bf16", **settings}


def _check_gpu_layouts(references: dict, root: str) -> None:
    with Distributed(DistributedConfig(seed=SEED, timeout=120, backend="nccl")):
        for model in GPU_MODELS:
            for label, settings in GPU_LAYOUTS.items():
                run_config = _run_config(model, Path(root) / f"{model}-{label}", 1, **_gpu_settings(**settings))
                trainer = Trainer(run_config, distributed=Distributed(run_config.distributed), log=lambda _: None)
                trainer.run()
                for step, (record, expected) in enumerate(zip(_history(trainer), references[model], strict=True)):
                    message = f"{model} {label} on 2 GPUs, step {step + 1}"
                    torch.testing.assert_close(record["loss"], expected["loss"], **GPU_TOLERANCE, msg=message)
                    torch.testing.assert_close(record["norm"], expected["norm"], **GPU_TOLERANCE, msg=message)
                dist.barrier()


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_sequence_data_parallel_on_two_gpus_matches_one(tmp_path):
    references = {}
    for model in GPU_MODELS:
        run_config = _run_config(model, tmp_path / f"one-gpu-{model}", 1, **_gpu_settings())
        trainer = Trainer(run_config, log=lambda _: None)
        trainer.run()
        references[model] = _history(trainer)
        trainer.close()
    run_distributed(2, _check_gpu_layouts, references, str(tmp_path))
