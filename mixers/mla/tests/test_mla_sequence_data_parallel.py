"""A language model of MLA blocks trained with sequence-data parallelism and micro-sequences gives the single-process
run: each step's loss and gradient norm, the last step's every gradient and the weights after 3 AdamW steps (the
`Trainer` on gloo against the same run in the test process, as tests/test_sequence_data_parallel.py does for the
other mixers); micro-sequences in one process give the whole micro-batch's loss and every gradient. The data: random
documents of 2 to 9 tokens packed into sequences of 16, two a micro-batch (32 tokens), so documents cross every slice
boundary and documents shorter than a slice sit inside slices, in every layout.

Two blocks: a plain query without rotary bias terms, and a low-rank query with biases, random norms and interleaved
rotary. 2 ranks: one slice a rank, and micro-sequences of 4 (the latents carried over 4 steps). 4 ranks (slow): one
slice a rank, and sequence-data × tensor parallel (the heads split, the gathered latents expanded to each rank's
heads), with and without sequence-tensor parallel (each slice's tokens split again over the tensor ranks, the
latents gathered over both groups), one slice a rank and in micro-sequences.
"""

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from blockzoo.config import structure
from blockzoo.data.dataset import build_dataset
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.runtime import Distributed
from blockzoo.model.language_model import LanguageModel
from blockzoo.run_config import RunConfig
from blockzoo.training.step import place_micro_batch
from blockzoo.training.trainer import Trainer
from blockzoo_testing.distributed import run_distributed

SEED = 1234
STEPS = 3
# fp32, the ranks sum in another order than one process (the tolerances of tests/test_sequence_data_parallel.py).
LOSS_TOLERANCE = {"rtol": 2e-5, "atol": 1e-7}
GRADIENT_TOLERANCE = {"rtol": 1e-4, "atol": 1e-6}
WEIGHT_TOLERANCE = {"rtol": 2e-5, "atol": 5e-4}
TRAINED_GRADIENT_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}

RANDOM_NORM = {"type": "rms_norm", "weight": {"initialization": {"type": "normal", "mean": 1.0, "std": 0.3}}}
SMALL = {"type": "mla", "heads": 4, "key_value_rank": 8, "nope_head_size": 6, "rotary_head_size": 4}
MIXERS = {
    "plain": {**SMALL, "value_head_size": 5, "rotary": {"type": "default", "theta": 100.0}},
    "low_rank": {
        **SMALL,
        "value_head_size": 7,
        "query_rank": 12,
        "add_linear_biases": True,
        # Its key rows' bias adds one constant to a query's logits: a zero gradient but for rounding, which Adam would
        # turn into updates of its own in each layout (test_mla_slices.py checks that gradient over slices).
        "key_value_up": {"bias": {"enabled": False}},
        "query_norm": RANDOM_NORM,
        "key_value_norm": RANDOM_NORM,
        "interleaved_rotary": True,
    },
}
MODEL = {
    "hidden_size": 32,
    "tied_embedding_weight": True,
    "embeddings": {"vocab_size": 64},
    "decoder": {
        "type": "pattern",
        "num_blocks": 2,
        "pattern": list(MIXERS),
        "blocks": {
            name: {
                "mixer": mixer,
                "mlp": {"type": "mlp", "intermediate_size": 48, "gated": True},
                "normalization": RANDOM_NORM,
            }
            for name, mixer in MIXERS.items()
        },
    },
    "head": {"normalization": RANDOM_NORM},
}
DATA = {"type": "random", "sequence_length": 16, "micro_batch_size": 2, "min_document_length": 2}
DATA |= {"max_document_length": 9}

# label -> distributed settings; the data-parallel size is what the world leaves.
LAYOUTS = {
    2: {
        "sdp2": {"sequence_data_parallel": 2},
        "sdp2-micro4": {"sequence_data_parallel": 2, "micro_sequence_length": 4},
    },
    4: {
        "sdp4": {"sequence_data_parallel": 4},
        "sdp2-tp2": {"sequence_data_parallel": 2, "tensor_parallel": 2},
        "sdp2-tp2-micro4": {"sequence_data_parallel": 2, "tensor_parallel": 2, "micro_sequence_length": 4},
        "sdp2-stp2": {"sequence_data_parallel": 2, "tensor_parallel": 2, "sequence_tensor_parallel": True},
        "sdp2-stp2-micro4": {
            "sequence_data_parallel": 2,
            "tensor_parallel": 2,
            "sequence_tensor_parallel": True,
            "micro_sequence_length": 4,
        },
    },
}


def _run_config(output_dir: Path, accumulation: int, **distributed) -> RunConfig:
    training = {
        "train_iters": STEPS,
        "gradient_accumulation": accumulation,
        "optimizer": {"learning_rate": 0.01},
        "schedule": {"warmup_iters": 1},
        "log_interval": 100,
        "output_dir": str(output_dir),
    }
    data = {
        "model": copy.deepcopy(MODEL),
        "distributed": {"seed": SEED, "backend": "gloo", "timeout": 120, **distributed},
        "data": DATA,
        "training": training,
    }
    return structure(data, RunConfig)


def _single_process(config: DistributedConfig) -> Distributed:
    return Distributed(config, world_size=1, rank=0, local_rank=0)


def _history(trainer: Trainer) -> list[tuple[float, float]]:
    return [(record.loss, record.gradient_norm) for record in trainer.history]


def _global(tensor: torch.Tensor, parameter, distributed: Distributed) -> torch.Tensor:
    return parameter.meta.local_to_global(tensor.detach(), distributed.tensor_group, distributed.data_group)


# ---------------------------------------------------------------------------------------------------------------------
# Micro-sequences in one process


def _loss_and_gradients(model: LanguageModel, micro, distributed: Distributed) -> tuple[torch.Tensor, dict]:
    placed = place_micro_batch(micro, distributed)
    model.zero_grad(set_to_none=True)
    cross_entropy, losses = model.loss(placed.tokens, placed.labels, placed.batch)
    (cross_entropy / placed.labelled() + sum(losses.values())).backward()
    return cross_entropy.detach(), {name: parameter.grad.clone() for name, parameter in model.named_parameters()}


@pytest.mark.parametrize("micro_sequence_length", [4, 8])
def test_micro_sequences_give_the_whole_sequence_step(micro_sequence_length):
    run_config = _run_config(Path("unused"), 1)
    whole = _single_process(run_config.distributed)
    chunked = _single_process(DistributedConfig(seed=SEED, backend="gloo", micro_sequence_length=micro_sequence_length))
    model = LanguageModel(run_config.model, whole)
    dataset = build_dataset(run_config.data, seed=SEED, model_vocab_size=run_config.model.embeddings.vocab_size)
    micro = next(dataset.training_batches())
    expected_loss, expected_grads = _loss_and_gradients(model, micro, whole)
    loss, grads = _loss_and_gradients(model, micro, chunked)  # the same model, the micro-batch placed in chunks
    torch.testing.assert_close(loss, expected_loss, **LOSS_TOLERANCE)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], **GRADIENT_TOLERANCE, msg=name)
        assert expected_grads[name].abs().max() > 0, name  # every weight took part


# ---------------------------------------------------------------------------------------------------------------------
# In the spawned ranks


def _check_layout(label: str, settings: dict, root: Path, reference: dict) -> None:
    run_config = _run_config(root / label, 1, **settings)
    trainer = Trainer(run_config, distributed=Distributed(run_config.distributed), log=lambda _: None)
    trainer.run()
    history = _history(trainer)
    assert len(history) == len(reference["history"]) == STEPS, label
    for step, ((loss, norm), (expected_loss, expected_norm)) in enumerate(zip(history, reference["history"]), 1):
        torch.testing.assert_close(loss, expected_loss, **LOSS_TOLERANCE, msg=f"{label}, step {step}: loss")
        torch.testing.assert_close(norm, expected_norm, **LOSS_TOLERANCE, msg=f"{label}, step {step}: grad norm")
    distributed = trainer.distributed
    for name, parameter in trainer.model.named_parameters():
        message = f"{label}: {name}"
        gradient = _global(parameter.grad, parameter, distributed)
        torch.testing.assert_close(gradient, reference["gradients"][name], **TRAINED_GRADIENT_TOLERANCE, msg=message)
        weight = _global(parameter, parameter, distributed)
        torch.testing.assert_close(weight, reference["weights"][name], **WEIGHT_TOLERANCE, msg=message)
        assert (weight - reference["initial"][name]).abs().max() > 1e-3, f"{message} did not train"
    trainer.close()


def _check_layouts(world_size: int, references: dict, root: str) -> None:
    with Distributed(DistributedConfig(seed=SEED, backend="gloo", timeout=120)):
        for label, settings in LAYOUTS[world_size].items():
            _check_layout(label, settings, Path(root), references[label])
            dist.barrier()


# ---------------------------------------------------------------------------------------------------------------------
# In the test process


def _references(world_size: int, root: Path) -> dict:
    """The single-process run of each layout: as many micro-batches a step as the layout has data ranks."""
    runs, references = {}, {}
    for label, settings in LAYOUTS[world_size].items():
        data_size = world_size // (settings.get("tensor_parallel", 1) * settings["sequence_data_parallel"])
        if data_size not in runs:
            trainer = Trainer(_run_config(root / f"single-{data_size}", data_size), log=lambda _: None)
            trainer.run()
            fresh = LanguageModel(trainer.run_config.model, _single_process(trainer.run_config.distributed))
            runs[data_size] = {
                "history": _history(trainer),
                "gradients": {name: parameter.grad.clone() for name, parameter in trainer.model.named_parameters()},
                "weights": {name: parameter.detach() for name, parameter in trainer.model.named_parameters()},
                "initial": {name: parameter.detach() for name, parameter in fresh.named_parameters()},
            }
        references[label] = runs[data_size]
    return references


def _matches_the_single_process_run(world_size: int, root: Path) -> None:
    run_distributed(world_size, _check_layouts, world_size, _references(world_size, root), str(root))


@pytest.mark.distributed
def test_two_ranks_match_the_single_process_run(tmp_path):
    _matches_the_single_process_run(2, tmp_path)


@pytest.mark.slow
@pytest.mark.distributed
def test_four_ranks_with_tensor_parallel_match_the_single_process_run(tmp_path):
    _matches_the_single_process_run(4, tmp_path)
