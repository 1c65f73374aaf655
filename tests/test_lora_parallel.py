"""LoRA training under tensor, sequence-tensor and data parallelism (and ZeRO) gives the single-process run: the
loss and gradient norm of every step and the trained adapters (global tensors), the base weights untouched.

Adapters on every kind of linear: column-parallel (query, gate‖up's up part: B split on its output rows),
row-parallel (dense, down: A split on its input columns), the value part of key‖value (column-parallel under TP 2,
GQA's groups split), and MQA's key‖value replicated inside the tensor region. Dropout 0: a rank's dropout mask is
its own, so only a run without dropout can equal the single process. Pipeline parallelism (two stages, two
micro-batches a step) too: each stage's adapters against the single process's. One gloo spawn of 2 ranks runs every
layout.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformer_reference import SEED, attention, block, model_data, run_data, single_process

import blockzoo
from blockzoo.checkpoint import latest_checkpoint
from blockzoo.config import structure
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.runtime import Distributed
from blockzoo.run_config import RunConfig
from blockzoo.training.trainer import Trainer
from blockzoo_testing.distributed import run_distributed

LOSS_TOLERANCE = {"rtol": 1e-5, "atol": 0.0}
WEIGHT_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
ADAPTED = {"apply_peft": True}


def _model(mixer: dict) -> dict:
    mixer = {**mixer, "dense": ADAPTED}
    mlp = {"type": "mlp", "intermediate_size": 48, "gated": True, "up": ADAPTED, "down": ADAPTED}
    decoder = {"type": "fixed", "num_blocks": 2, "block": {**block(mixer), "mlp": mlp}}
    return {**model_data(tied=True, decoder=decoder), "peft": {"type": "lora", "rank": 4, "alpha": 8.0}}


MODELS = {"gqa": _model(attention()), "mqa": _model({**attention(heads=4, head_groups=1), "head_size": 8})}
LAYOUTS = {
    "tp2-gqa": ("gqa", {"tensor_parallel": 2}),
    "stp2-gqa": ("gqa", {"tensor_parallel": 2, "sequence_tensor_parallel": True}),
    "stp2-mqa": ("mqa", {"tensor_parallel": 2, "sequence_tensor_parallel": True}),
    "dp2": ("gqa", {}),
    "dp2-zero3": ("gqa", {"zero_stage": 3}),
    "pp2": ("gqa", {"pipeline_parallel": 2}),
    "pp2-base": ("gqa-base", {"pipeline_parallel": 2}),  # from a pretrained base: checkpoints of the adapters only
}
DATA = {
    "type": "random",
    "sequence_length": 16,
    "micro_batch_size": 2,
    "min_document_length": 2,
    "max_document_length": 9,
}
STEPS = 3


def _run_config(model: str, output_dir: Path, data_size: int = 1, **distributed) -> RunConfig:
    training = {
        "train_iters": STEPS,
        "gradient_accumulation": data_size,
        "optimizer": {"learning_rate": 0.01},
        "schedule": {"warmup_iters": 1},
        "evaluation": {"interval": None},
        "log_interval": 100,
        "output_dir": str(output_dir),
    }
    if model == "gqa-base":  # the base beside every run's output directory (`_save_base`)
        data = run_data(MODELS["gqa"], data=DATA, training=training)
        data["model"] = {"pretrained": str(output_dir.parent / "base"), "peft": MODELS["gqa"]["peft"]}
    else:
        data = run_data(MODELS[model], data=DATA, training=training)
    data["distributed"].update(timeout=60, **distributed)
    return structure(data, RunConfig)


def _global_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    group = trainer.distributed.tensor_group
    return {
        name: parameter.meta.local_to_global(parameter.detach(), group)
        for name, parameter in trainer.model.named_parameters()
    }


def _micro_batches(settings: dict) -> tuple[int, int]:
    """(micro-batches per rank and step, those of the single-process reference): a data-parallel layout's reference
    accumulates both ranks' micro-batches; a pipeline needs a micro-batch per stage."""
    if settings.get("pipeline_parallel", 1) > 1:
        return 2, 2
    return 1, 2 // settings.get("tensor_parallel", 1)


def _reference(model: str, data_size: int, output_dir: Path) -> dict:
    trainer = Trainer(_run_config(model, output_dir, data_size), distributed=single_process(), log=lambda _: None)
    initial = {name: parameter.detach().clone() for name, parameter in trainer.model.named_parameters()}
    trainer.run()
    history = [(record.loss, record.gradient_norm) for record in trainer.history]
    return {"history": history, "weights": _global_weights(trainer), "initial": initial}


def _check_layouts(references: dict, root: str) -> None:
    with Distributed(DistributedConfig(seed=SEED, backend="gloo", timeout=60)):
        for label, (model, settings) in LAYOUTS.items():
            run_config = _run_config(model, Path(root) / label, _micro_batches(settings)[0], **settings)
            trainer = Trainer(run_config, distributed=Distributed(run_config.distributed), log=lambda _: None)
            trainer.run()
            reference = references[label]
            for record, (loss, norm) in zip(trainer.history, reference["history"], strict=True):
                torch.testing.assert_close(record.loss, loss, **LOSS_TOLERANCE, msg=f"{label} {record.step}: loss")
                torch.testing.assert_close(record.gradient_norm, norm, **LOSS_TOLERANCE, msg=f"{label}: grad norm")
            weights = _global_weights(trainer)
            if settings.get("pipeline_parallel", 1) > 1:  # this rank's stage
                assert weights and weights.keys() < reference["weights"].keys()
                assert any(".adapter." in name for name in weights)
            else:
                assert weights.keys() == reference["weights"].keys()
            for name, weight in weights.items():
                expected = reference["weights"][name]
                torch.testing.assert_close(weight, expected, **WEIGHT_TOLERANCE, msg=f"{label}: {name}")
                moved = (expected - reference["initial"][name]).abs().max() > 1e-3
                assert moved == (".adapter." in name), f"{label}: {name} trained: {bool(moved)}"
            dist.barrier()


def _save_base(directory: Path) -> None:
    """The gqa model without its peft, with random weights: the base of the `gqa-base` runs."""
    model = {key: value for key, value in MODELS["gqa"].items() if key != "peft"}
    blockzoo.save(blockzoo.build(structure(run_data(model), RunConfig)), directory)


@pytest.mark.distributed
def test_lora_training_in_parallel_matches_single_process(tmp_path):
    _save_base(tmp_path / "base")
    runs, references = {}, {}
    for label, (model, settings) in LAYOUTS.items():
        key = (model, _micro_batches(settings)[1])
        if key not in runs:
            runs[key] = _reference(*key, tmp_path / f"reference-{key[0]}-{key[1]}")
        references[label] = runs[key]
    run_distributed(2, _check_layouts, references, str(tmp_path))
    # The pipeline's stages wrote their adapters into one checkpoint, which loads with its base as one model.
    last = latest_checkpoint(tmp_path / "pp2-base")
    assert all(".adapter." in name for name in load_file(last / "model.safetensors"))
    expected = references["pp2-base"]["weights"]
    loaded = dict(blockzoo.load(last).named_parameters())
    assert loaded.keys() == expected.keys()
    for name, weight in loaded.items():
        torch.testing.assert_close(weight, expected[name], **WEIGHT_TOLERANCE, msg=name)
