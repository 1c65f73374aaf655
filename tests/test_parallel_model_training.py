"""Tensor-parallel, sequence-tensor-parallel and data-parallel training of the whole transformer (attention and MLP
plugins, core decoder, trainer, optimizer, checkpoints) give the single-process run.

Each layout runs the `Trainer` for a few steps on gloo, against the single-process run trained once in the test
process (same seed, same samples: the reference of a data-parallel layout accumulates as many micro-batches per
step as there are data-parallel ranks). Compared: the loss, gradient norm and evaluation loss of every step, and
the final weights reassembled to global tensors. One spawn per world size runs all of its layouts.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformer_reference import RANDOM_NORM, SEED, attention, block, model_data, run_data, single_process

import blockzoo
from blockzoo.config import structure
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.runtime import Distributed
from blockzoo.model.language_model import LanguageModel
from blockzoo.run_config import RunConfig
from blockzoo.training.trainer import Trainer
from blockzoo_testing.distributed import run_distributed

# The ranks sum in another order than the single process (fp32). Weights: 4 AdamW steps of lr 0.01 (clipped at
# norm 1, so clipping acts): Adam's normalized update turns a relative gradient difference of ~1e-6 into weight
# differences well below 1e-5.
LOSS_TOLERANCE = {"rtol": 1e-5, "atol": 0.0}
WEIGHT_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
RANDOM_BIAS = {"bias": {"initialization": {"type": "normal", "std": 0.3}}}

# Tied embeddings, GQA (groups split by TP 2), random q/k/v/dense biases and per-head norms (replicated parameters
# whose gradients are partial per rank), a gated MLP with biases.
GQA_MODEL = model_data(
    tied=True,
    decoder={
        "type": "fixed",
        "num_blocks": 2,
        "block": {
            **block(attention()),
            "mixer": {
                **attention(),
                "add_linear_biases": True,
                **{name: RANDOM_BIAS for name in ("query", "key", "value", "dense")},
                "query_norm": RANDOM_NORM,
                "key_norm": RANDOM_NORM,
            },
            "mlp": {
                "type": "mlp",
                "intermediate_size": 48,
                "gated": True,
                "add_linear_biases": True,
                "up": RANDOM_BIAS,
            },
        },
    },
)
# Untied, MQA with 8 heads: TP 4 splits the heads and replicates key/value inside the tensor region; a window.
MQA_MODEL = model_data(
    tied=False,
    decoder={
        "type": "fixed",
        "num_blocks": 2,
        "block": block({**attention(heads=8, head_groups=1, window=5), "head_size": 4, "key_norm": RANDOM_NORM}),
    },
)
DATA = {
    "type": "random",
    "sequence_length": 16,
    "micro_batch_size": 2,
    "min_document_length": 2,
    "max_document_length": 9,
}
STEPS = 4
EVALUATION_ITERS = 2

# label -> (model, distributed settings); the data-parallel size is what the world leaves.
LAYOUTS = {
    2: {
        "tp2": ("gqa", {"tensor_parallel": 2}),
        "stp2": ("gqa", {"tensor_parallel": 2, "sequence_tensor_parallel": True}),
        "dp2": ("gqa", {}),
    },
    4: {
        "tp4": ("mqa", {"tensor_parallel": 4}),
        "stp4": ("mqa", {"tensor_parallel": 4, "sequence_tensor_parallel": True}),
        "stp2-dp2": ("gqa", {"tensor_parallel": 2, "sequence_tensor_parallel": True}),
    },
}
MODELS = {"gqa": GQA_MODEL, "mqa": MQA_MODEL}


def _run_config(model: str, output_dir: Path, data_size: int = 1, **distributed) -> RunConfig:
    """The run; with `data_size` > 1 (the single-process reference of a data-parallel layout) each step accumulates
    that many micro-batches and each evaluation reads that many more, to see the samples all data ranks see."""
    training = {
        "train_iters": STEPS,
        "gradient_accumulation": data_size,
        "optimizer": {"learning_rate": 0.01},
        "schedule": {"warmup_iters": 1},
        "evaluation": {"interval": 2, "iters": EVALUATION_ITERS * data_size},
        "log_interval": 100,
        "output_dir": str(output_dir),
    }
    data = run_data(MODELS[model], data=DATA, training=training)
    data["distributed"].update(timeout=60, **distributed)
    return structure(data, RunConfig)


def _train(run_config: RunConfig, distributed: Distributed) -> Trainer:
    trainer = Trainer(run_config, distributed=distributed, log=lambda _: None)
    trainer.run()
    return trainer


def _single_process_run(model: str, data_size: int, output_dir: Path) -> dict:
    run_config = _run_config(model, output_dir, data_size)
    trainer = _train(run_config, single_process())
    return {
        "history": [(record.loss, record.gradient_norm) for record in trainer.history],
        "evaluations": trainer.evaluations,
        "weights": {name: parameter.detach() for name, parameter in trainer.model.named_parameters()},
        "initial": dict(LanguageModel(run_config.model, single_process()).named_parameters()),
    }


def _global_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    group = trainer.distributed.tensor_group
    return {
        name: parameter.meta.local_to_global(parameter.detach(), group)
        for name, parameter in trainer.model.named_parameters()
    }


def _check_layout(label: str, model: str, settings: dict, reference: dict, root: Path) -> Trainer:
    run_config = _run_config(model, root / label, **settings)
    trainer = _train(run_config, Distributed(run_config.distributed))
    for record, (loss, gradient_norm) in zip(trainer.history, reference["history"], strict=True):
        message = f"{label}, step {record.step}"
        torch.testing.assert_close(record.loss, loss, **LOSS_TOLERANCE, msg=f"{message}: loss")
        torch.testing.assert_close(record.gradient_norm, gradient_norm, **LOSS_TOLERANCE, msg=f"{message}: grad norm")
    assert len(trainer.evaluations) == 2
    for (step, loss), (_, expected) in zip(trainer.evaluations, reference["evaluations"], strict=True):
        torch.testing.assert_close(loss, expected, **LOSS_TOLERANCE, msg=f"{label}: evaluation at step {step}")
    weights = _global_weights(trainer)
    assert weights.keys() == reference["weights"].keys()
    for name, weight in weights.items():
        torch.testing.assert_close(weight, reference["weights"][name], **WEIGHT_TOLERANCE, msg=f"{label}: {name}")
        # Training moved every weight far beyond the tolerance: equal weights mean equal updates.
        assert (weight - reference["initial"][name]).abs().max() > 1e-3, f"{label}: {name} did not train"
    return trainer


def _check_checkpoint_loads_in_one_process(trainer: Trainer) -> None:
    """The run's last checkpoint (written from TP shards) loads into a single-process model: the global weights
    exactly, and the logits of the parallel model."""
    loaded = blockzoo.load(trainer.output_dir)
    assert loaded.distributed.tensor_size == 1 and loaded.distributed.world_size == 1
    weights = _global_weights(trainer)
    for name, parameter in loaded.named_parameters():
        assert torch.equal(parameter.detach(), weights[name]), name
    input_ids = torch.randint(0, loaded.vocab_size, (3, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids), trainer.model(input_ids), atol=1e-5, rtol=1e-5)


def _check_layouts(world_size: int, references: dict, root: str) -> None:
    # The first Distributed starts the process group; each layout lays its ranks out on it.
    with Distributed(DistributedConfig(seed=SEED, backend="gloo", timeout=60)):
        for label, (model, settings) in LAYOUTS[world_size].items():
            trainer = _check_layout(label, model, settings, references[label], Path(root))
            if label == "tp2":
                _check_checkpoint_loads_in_one_process(trainer)
            dist.barrier()


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", LAYOUTS)
def test_parallel_training_matches_single_process(world_size, tmp_path):
    runs = {}
    for model, settings in LAYOUTS[world_size].values():
        data_size = world_size // settings.get("tensor_parallel", 1)
        if (model, data_size) not in runs:
            runs[model, data_size] = _single_process_run(model, data_size, tmp_path / f"{model}-{data_size}")
    references = {
        label: runs[model, world_size // settings.get("tensor_parallel", 1)]
        for label, (model, settings) in LAYOUTS[world_size].items()
    }
    run_distributed(world_size, _check_layouts, world_size, references, str(tmp_path))
