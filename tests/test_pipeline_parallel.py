"""Pipeline parallelism (torch.distributed.pipelining, composed with tensor, sequence-tensor and data parallelism)
gives the single-process run.

The direct check drives the stages and the schedule without the trainer: each rank builds its stages of the model
(`build_pipeline_model`) and runs one step's micro-batches through `Pipeline.step`; the single-process model (built
in every rank from the same seed) runs the same micro-batches one after the other with the same loss weights. The
cross-entropy, every named loss (MoE router losses from both stages) and every parameter's gradient (the tied
weight's on both of its stages) must be those of the single process.

The trainer check runs `Trainer` with a pipeline against the single-process trainer (trained once in the test process,
same seed and samples; the reference of a data-parallel layout accumulates the micro-batches of every data rank):
losses, named losses, gradient norms and evaluation losses of every step, and the final weights. Checkpoints: the
pp2 × tp2 run's step-2 checkpoint resumes on one process, and the single process's resumes under pp2 × tp2, each
giving the reference's last steps; the tied weight is one tensor of the checkpoint. One spawn per world size runs all
of its layouts.
"""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformer_reference import RANDOM_NORM, SEED, VOCAB, attention, block, model_data, single_process

import blockzoo
from blockzoo.checkpoint import MODEL_FILE
from blockzoo.config import structure, update
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.pipeline import Pipeline, PipelineMicroBatch, build_pipeline_model, local_stages
from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.base import IGNORE_INDEX, Batch
from blockzoo.layers.parameter import uninitialized
from blockzoo.model.factory import load_pretrained_weights
from blockzoo.model.language_model import LanguageModel
from blockzoo.run_config import RunConfig
from blockzoo.training.optimizer import unique_trainable
from blockzoo.training.trainer import Trainer
from blockzoo_testing.distributed import run_distributed

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


def _expert_parallel(decoder: dict) -> dict:
    """`decoder` with the experts of its MoE layers split over the data-parallel ranks."""
    blocks = {
        name: {**block, "mlp": {**block["mlp"], "expert_parallel": True}} if block["mlp"]["type"] == "moe" else block
        for name, block in decoder["blocks"].items()
    }
    return {**decoder, "blocks": blocks}


MODELS = {
    "pattern-4": model_data(tied=True, decoder=_pattern(4)),
    "pattern-6": model_data(tied=False, decoder=_pattern(6)),
    "hybrid-moe": model_data(tied=True, decoder=HYBRID_MOE),
    "hybrid-moe, expert parallel": model_data(tied=True, decoder=_expert_parallel(HYBRID_MOE)),
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
        "pp2 dp2 hybrid moe, experts split over dp": ("hybrid-moe, expert parallel", {}, 2),
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
        cross_entropy += float(value.detach())
        named.append({name: float(loss.detach()) for name, loss in losses.items()})
    return {
        "cross_entropy": cross_entropy,
        "named": named,
        "labelled": labelled,
        "weights": {name: parameter.detach() for name, parameter in model.named_parameters()},
        "gradients": {name: parameter.grad for name, parameter in model.named_parameters()},
    }


def _reduce_gradients(model: LanguageModel, distributed: Distributed) -> None:
    """What the trainer does after the backward: partial gradients summed over the tensor group, then over the data
    group (but those of experts split over it, which hold every data rank's tokens already)."""
    parameters = unique_trainable(model.parameters())
    distributed.reduce_replicated_gradients(parameters)
    if distributed.data_group is not None:
        for parameter in parameters:
            if not parameter.meta.data_parallel_sharded:
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
    losses = pipeline.step(own, cross_entropy_divisor=reference["labelled"], named_loss_divisor=len(everything))
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


# -- through the trainer -------------------------------------------------------------------------------------------

# Losses and norms: the ranks sum in other orders than the single process (fp32; e.g. a tied weight's gradient is the
# first stage's sum plus the last stage's). Weights: 4 AdamW steps of lr 0.01, which move every weight by more than
# 1e-3 (checked); Adam's normalized update turns such reorderings of a gradient entry near zero into weight
# differences of up to a few 1e-5 (seen: 2.7e-5 on one element of 1024), far below what training moves.
LOSS_TOLERANCE = {"rtol": 1e-5, "atol": 0.0}
WEIGHT_TOLERANCE = {"rtol": 1e-5, "atol": 1e-4}
STEPS, EVALUATION_ITERS = 4, 2
DATA = {"type": "random", "sequence_length": 16, "micro_batch_size": 2, "min_document_length": 2}
DATA["max_document_length"] = 9
RECOMPUTE = {"recompute": "selective", "recompute_blocks": {"ssm": "full"}}
# label -> (model, distributed settings, micro-batches per step on each data rank)
TRAINER_LAYOUTS = {
    2: {
        "trainer pp2, tied": ("pattern-4", {}, 2),
        # Recomputation changes nothing but memory: the reference runs without it.
        "trainer pp2 interleaved, hybrid moe, recompute": ("hybrid-moe", {**INTERLEAVED, "training": RECOMPUTE}, 2),
    },
    4: {
        "trainer pp2 tp2": ("pattern-4", {"tensor_parallel": 2}, 2),
        "trainer pp2 dp2 zero3": ("pattern-4", {"zero_stage": 3}, 2),
    },
}
CHECKPOINTED = "trainer pp2 tp2"  # its step-2 checkpoint resumes on one process, and the reverse


def _trainer_config(
    model: str, output_dir: Path, micro_batches: int, data_size: int = 1, training: dict | None = None, **distributed
) -> RunConfig:
    """The run; `data_size` > 1 for the single-process reference of a data-parallel layout: each evaluation then
    reads that many more micro-batches, as many as all data ranks read. `training`: more training settings."""
    training = {
        **(training or {}),
        "train_iters": STEPS,
        "gradient_accumulation": micro_batches,
        "optimizer": {"learning_rate": 0.01},
        "schedule": {"warmup_iters": 1},
        "evaluation": {"interval": 2, "iters": EVALUATION_ITERS * data_size},
        "log_interval": 100,
        "checkpoint_interval": 2,
        "output_dir": str(output_dir),
    }
    distributed = {"seed": SEED, "backend": "gloo", "timeout": 60, **distributed}
    return structure(
        {"model": MODELS[model], "distributed": distributed, "data": DATA, "training": training}, RunConfig
    )


def _figures(trainer: Trainer) -> dict:
    return {
        "history": [(record.loss, record.gradient_norm, record.losses) for record in trainer.history],
        "evaluations": trainer.evaluations,
        "weights": {name: parameter.detach().clone() for name, parameter in trainer.model.named_parameters()},
        "initial": dict(LanguageModel(trainer.run_config.model, single_process()).named_parameters()),
    }


def _reference_runs(world_size: int, root: Path) -> dict:
    """label -> the single-process run of each trainer layout (runs shared by layouts of one model and step)."""
    runs, references = {}, {}
    for label, (model, settings, count) in TRAINER_LAYOUTS[world_size].items():
        data_size = world_size // 2 // settings.get("tensor_parallel", 1)
        if (model, data_size) not in runs:
            output_dir = root / f"reference {model} {data_size}"
            run_config = _trainer_config(model, output_dir, count * data_size, data_size)
            trainer = Trainer(run_config, distributed=single_process(), log=lambda _: None)
            trainer.run()
            runs[model, data_size] = {**_figures(trainer), "output_dir": output_dir}
        references[label] = runs[model, data_size]
    return references


def _compare(label: str, trainer: Trainer, reference: dict, first_step: int = 0) -> None:
    expected = reference["history"][first_step:]
    for record, (loss, norm, named) in zip(trainer.history, expected, strict=True):
        message = f"{label}, step {record.step}"
        torch.testing.assert_close(record.loss, loss, **LOSS_TOLERANCE, msg=f"{message}: loss")
        torch.testing.assert_close(record.gradient_norm, norm, **LOSS_TOLERANCE, msg=f"{message}: gradient norm")
        assert record.losses.keys() == named.keys(), f"{message}: named losses {sorted(record.losses)}"
        for name, value in record.losses.items():
            torch.testing.assert_close(value, named[name], **LOSS_TOLERANCE, msg=f"{message}: {name}")
    evaluations = [(step, loss) for step, loss in reference["evaluations"] if step > first_step]
    for (step, loss), (_, expected_loss) in zip(trainer.evaluations, evaluations, strict=True):
        torch.testing.assert_close(loss, expected_loss, **LOSS_TOLERANCE, msg=f"{label}: evaluation at step {step}")
    distributed = trainer.distributed
    for name, parameter in trainer.model.named_parameters():
        weight = parameter.meta.local_to_global(parameter.detach(), distributed.tensor_group, distributed.data_group)
        torch.testing.assert_close(
            weight,
            reference["weights"][name],
            **WEIGHT_TOLERANCE,
            msg=lambda text, name=name: f"{label}: {name}: {text}",
        )
        # Equal weights mean equal updates: training moved every weight far beyond the tolerance.
        assert (weight - reference["initial"][name]).abs().max() > 1e-3, f"{label}: {name} did not train"


def _check_training(label: str, model: str, settings: dict, count: int, reference: dict, root: Path) -> None:
    run_config = _trainer_config(model, root / label, count, pipeline_parallel=2, **settings)
    messages = []
    trainer = Trainer(run_config, distributed=Distributed(run_config.distributed), log=messages.append)
    trainer.run()
    _compare(label, trainer, reference)
    if trainer.distributed.rank == 0:  # the memory of each pipeline stage is reported at the start
        assert "stage 0: parameters" in messages[0] and "stage 1: parameters" in messages[0], messages[0]
    if label != CHECKPOINTED:
        return
    # The single process's step-2 checkpoint, resumed under this layout, gives the reference's last steps.
    resumed = root / f"{label}, resumed"
    if trainer.distributed.rank == 0:
        shutil.copytree(reference["output_dir"] / "step_2", resumed / "step_2")
    torch.distributed.barrier()
    resumed_config = update(run_config, {"training": {"output_dir": str(resumed)}})
    trainer = Trainer(resumed_config, distributed=Distributed(run_config.distributed), log=lambda _: None)
    assert trainer.step == 2, f"{label}: resumed at step {trainer.step}"
    trainer.run()
    _compare(f"{label}, resumed from the single process", trainer, reference, first_step=2)


def _check_pipeline_checkpoint_in_one_process(run_directory: Path, reference: dict, root: Path) -> None:
    """The pipelined run's checkpoints hold every parameter once (the tied weight under the embedding's name); the
    last loads in one process with the trained weights, and its step-2 one resumes there into the reference's last
    steps (weights and optimizer state)."""
    with safe_open(str(run_directory / "step_4" / MODEL_FILE), framework="pt") as weights:
        assert set(weights.keys()) == set(reference["weights"]), sorted(set(weights.keys()) ^ set(reference["weights"]))
    loaded = blockzoo.load(run_directory)
    assert loaded.distributed.world_size == 1
    for name, parameter in loaded.named_parameters():
        torch.testing.assert_close(parameter.detach(), reference["weights"][name], **WEIGHT_TOLERANCE, msg=name)
    resumed = root / "single process, resumed from the pipeline"
    shutil.copytree(run_directory / "step_2", resumed / "step_2")
    model, _, count = TRAINER_LAYOUTS[4][CHECKPOINTED]
    trainer = Trainer(_trainer_config(model, resumed, count), distributed=single_process(), log=lambda _: None)
    assert trainer.step == 2
    trainer.run()
    _compare("the single process resumed from pp2 tp2", trainer, reference, first_step=2)


# A model the llama format holds (GQA attention, gated MLP, tied weights), for the pretrained check.
LLAMA_MODEL = model_data(tied=True)


def _check_pretrained(root: Path) -> None:
    """A pipeline stage takes its parameters from a Hugging Face checkpoint and from a native one of the whole model
    (`model.pretrained` under pipeline parallelism), exactly."""
    run_config = structure({"model": LLAMA_MODEL, "distributed": {"seed": SEED, "backend": "gloo"}}, RunConfig)
    run_config = update(run_config, {"distributed": {"pipeline_parallel": 2}, "training": {"gradient_accumulation": 2}})
    distributed = Distributed(run_config.distributed)
    for source in (root / "llama", root / "native"):
        expected = dict(blockzoo.load(source).named_parameters())
        with uninitialized():
            model = build_pipeline_model(run_config.model, distributed)
        load_pretrained_weights(model, source, distributed)
        for name, parameter in model.named_parameters():
            assert torch.equal(parameter.detach(), expected[name].detach()), f"{source.name}: {name}"
    distributed.shutdown()


def _check_layouts(world_size: int, references: dict, root: str) -> None:
    with Distributed(DistributedConfig(seed=SEED, backend="gloo", timeout=60)):
        for label, (model, settings, count) in LAYOUTS[world_size].items():
            _check_step(label, model, settings, count)
            torch.distributed.barrier()
        if world_size == 2:
            _check_pretrained(Path(root))
        for label, (model, settings, count) in TRAINER_LAYOUTS[world_size].items():
            _check_training(label, model, settings, count, references[label], Path(root))
            torch.distributed.barrier()


def _check_on_gpus() -> None:
    nccl = {"backend": "nccl"}
    with Distributed(DistributedConfig(seed=SEED, timeout=120, **nccl)):
        for label, (model, settings, count) in LAYOUTS[2].items():
            _check_step(f"{label} (cuda)", model, {**settings, **nccl}, count, tolerance=GPU_TOLERANCE)
            torch.distributed.barrier()


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", LAYOUTS)
def test_pipeline_matches_single_process(world_size, tmp_path):
    references = _reference_runs(world_size, tmp_path)
    if world_size == 2:  # the checkpoints of the pretrained check, from a single-process model
        model = blockzoo.build(structure({"model": LLAMA_MODEL, "distributed": {"seed": 7}}, RunConfig))
        blockzoo.save(model, tmp_path / "llama", format="llama")
        blockzoo.save(model, tmp_path / "native")
    run_distributed(world_size, _check_layouts, world_size, references, str(tmp_path))
    if CHECKPOINTED in TRAINER_LAYOUTS[world_size]:
        _check_pipeline_checkpoint_in_one_process(tmp_path / CHECKPOINTED, references[CHECKPOINTED], tmp_path)


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_pipeline_step_on_two_gpus_matches_single_process():
    """The world-2 layouts on two GPUs (NCCL, fp32): the installed torch's pipelining with real devices."""
    run_distributed(2, _check_on_gpus)
