"""ZeRO stages 0-3 (FSDP2 over the data ranks), alone and with tensor, sequence-tensor and expert parallelism, give
the single-process run; checkpoints saved under ZeRO 3 × TP 2 resume on one process and the other way round, and
convert to Hugging Face; the memory each rank holds falls as 1/N under ZeRO 3.

Each layout runs the `Trainer` on gloo for a few steps, against the single-process run of the same model trained in
the test process (the same seed and samples: the reference accumulates as many micro-batches per step as all data
ranks together). Compared: the loss, gradient norm and named losses of every step, and the final weights reassembled
to global tensors. One spawn per world size runs all of its layouts. The matrix covers every stage and every
combination (dp2, dp4, tp2×dp2, stp2×dp2, expert parallelism over dp2) at least once, and each model: a transformer,
a hybrid (attention + Mamba 2 + MoE, with gradient accumulation, a frozen norm and per-component learning-rate
scales in Mamba 2's concatenated in_proj and attention's key‖value) and the example plugin's `shortconv.gated_conv`.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from transformer_reference import RANDOM_NORM, SEED, attention, block, model_data, run_data, single_process

import blockzoo
from blockzoo.config import structure
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.data_parallel import is_sharded
from blockzoo.distributed.runtime import Distributed
from blockzoo.model.factory import convert
from blockzoo.model.language_model import LanguageModel
from blockzoo.run_config import RunConfig
from blockzoo.training.trainer import Trainer
from blockzoo_testing.distributed import run_distributed

# fp32; the ranks sum in another order than the single process (FSDP reduce-scatters, then the tensor group sums).
# 3 AdamW steps of lr 0.01 clipped at norm 1: weights move by ~2e-2 (checked > 1e-3), most differences stay ~1e-7.
# Adam divides by sqrt(v) + 1e-8: an element whose gradient is ~1e-10 (seen: one output-weight element at step 1)
# turns a rounding-level difference into an update difference of up to ~lr/2, hence the weights' atol.
LOSS_TOLERANCE = {"rtol": 2e-5, "atol": 1e-7}
WEIGHT_TOLERANCE = {"rtol": 2e-5, "atol": 1e-4}
# bf16 compute (fp32 master weights, gathered in fp32): the ranks' micro-batches hold other samples than the single
# process's, so bf16 rounds other sums; the differences stay at bf16's resolution.
BF16_TOLERANCE = {"rtol": 2e-2, "atol": 2e-3}
# Measured: most updates within 6% of the single process's (Adam magnifies small gradients' rounding); a norm's
# weight, whose gradient sums small terms that cancel, up to 21%, and the bf16 single-process run is itself that far
# from the fp32 run on such a weight. A sharding error moves a weight by about its whole update; a gradient of the
# wrong scale shows in the gradient norms, compared to 2%.
BF16_UPDATE_TOLERANCE = 0.35
STEPS = 3

MOE = {
    "type": "moe",
    "experts": 4,
    "experts_per_token": 2,
    "intermediate_size": 24,
    "auxiliary_loss_coefficient": 0.0,  # its statistics are per micro-batch, whose samples differ between layouts
    "z_loss_coefficient": 0.01,
}


def hybrid(expert_parallel: bool = False) -> dict:
    """attention → Mamba 2 → MoE; per-component lr scales in key‖value and in_proj, a frozen head norm."""
    mamba_2 = {"type": "mamba_2", "heads": 4, "head_size": 8, "groups": 2, "state_size": 8, "chunk_size": 8}
    mamba_2 |= {"dt": {"lr_scale": 3.0}, "x": {"weight": {"weight_decay": False}}}
    decoder = {
        "type": "pattern",
        "num_blocks": 3,
        "pattern": ["attn", "ssm", "moe"],
        "blocks": {
            "attn": block({**attention(), "key": {"lr_scale": 0.5}}),
            "ssm": {"mixer": mamba_2, "mlp": {"type": "none"}},
            "moe": {"mixer": attention(), "mlp": {**MOE, "expert_parallel": expert_parallel}},
        },
    }
    model = model_data(tied=True, decoder=decoder)
    model["head"] = {"normalization": {**RANDOM_NORM, "lr_scale": 0.0}}
    return model


SHORTCONV = model_data(
    tied=False,
    decoder={
        "type": "pattern",
        "num_blocks": 2,
        "pattern": ["conv", "attn"],
        "blocks": {
            "conv": block({"type": "shortconv.gated_conv", "channels": 32, "kernel_size": 4}),
            "attn": block(attention()),
        },
    },
)
MODELS = {
    "transformer": model_data(tied=True),
    "hybrid": hybrid(),
    "hybrid-ep": hybrid(expert_parallel=True),
    "shortconv": SHORTCONV,
    # 63 rows of embeddings: FSDP shards them unevenly over 2 or 4 ranks.
    "transformer-63": {**model_data(tied=False), "embeddings": {"vocab_size": 63}},
}
DATA = {"type": "random", "sequence_length": 16, "micro_batch_size": 2, "min_document_length": 2}
DATA |= {"max_document_length": 9}

# label -> (model, distributed settings, gradient accumulation per rank); the data-parallel size is what is left.
LAYOUTS = {
    2: {
        "z0-dp2": ("transformer", {"zero_stage": 0}, 1),
        "z1-dp2-hybrid-accumulation": ("hybrid", {"zero_stage": 1}, 2),
        "z2-dp2-shortconv": ("shortconv", {"zero_stage": 2}, 1),
        "z3-dp2-hybrid-ep": ("hybrid-ep", {"zero_stage": 3}, 1),
        "z3-dp2-memory": ("transformer-63", {"zero_stage": 3}, 1),
        "z3-dp2-bf16": ("transformer", {"zero_stage": 3, "compute_dtype": "bf16"}, 2),
    },
    4: {
        "z3-dp4-memory": ("transformer-63", {"zero_stage": 3}, 1),
        "z2-tp2-dp2-hybrid-accumulation": ("hybrid", {"zero_stage": 2, "tensor_parallel": 2}, 2),
        "z1-stp2-dp2-shortconv": (
            "shortconv",
            {"zero_stage": 1, "tensor_parallel": 2, "sequence_tensor_parallel": True},
            1,
        ),
        "z0-tp2-dp2-hybrid-ep": ("hybrid-ep", {"zero_stage": 0, "tensor_parallel": 2}, 1),
        "z3-tp2-dp2-checkpoint": ("transformer", {"zero_stage": 3, "tensor_parallel": 2}, 1),
    },
}
CHECKPOINT_LAYOUT = "z3-tp2-dp2-checkpoint"


def _run_config(model: str, output_dir: Path, accumulation: int, train_iters: int = STEPS, **distributed) -> RunConfig:
    training = {
        "train_iters": train_iters,
        "gradient_accumulation": accumulation,
        "optimizer": {"learning_rate": 0.01},
        "schedule": {"warmup_iters": 1},
        "log_interval": 100,
        "output_dir": str(output_dir),
    }
    data = run_data(MODELS[model], data=DATA, training=training)
    data["distributed"].update(timeout=120, **distributed)
    return structure(data, RunConfig)


def _data_size(world_size: int, settings: dict) -> int:
    return world_size // settings.get("tensor_parallel", 1)


def _global(tensor: torch.Tensor, parameter, distributed: Distributed) -> torch.Tensor:
    """The global tensor of a parameter-shaped tensor of any layout (a collective of every rank)."""
    return parameter.meta.local_to_global(tensor.detach(), distributed.tensor_group, distributed.data_group)


def _global_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Weights and optimizer state, reassembled to global tensors (`<name>` and `<name>/<state key>`)."""
    state = {}
    for name, parameter in trainer.model.named_parameters():
        state[name] = _global(parameter, parameter, trainer.distributed)
        for key, value in trainer.optimizer.state.get(parameter, {}).items():
            state[f"{name}/{key}"] = _global(value, parameter, trainer.distributed) if value.ndim else value.cpu()
    return state


def _history(trainer: Trainer) -> list[dict]:
    return [{"loss": r.loss, "norm": r.gradient_norm, "losses": r.losses} for r in trainer.history]


def _single_process_run(
    model: str, accumulation: int, output_dir: Path, train_iters: int = STEPS, **distributed
) -> Trainer:
    trainer = Trainer(_run_config(model, output_dir, accumulation, train_iters, **distributed), log=lambda _: None)
    trainer.run()
    return trainer


def _assert_same_history(
    history: list[dict], reference: list[dict], label: str, tolerance: dict = LOSS_TOLERANCE
) -> None:
    assert len(history) == len(reference), label
    for step, (record, expected) in enumerate(zip(history, reference), start=1):
        message = f"{label}, step {step}"
        torch.testing.assert_close(record["loss"], expected["loss"], **tolerance, msg=f"{message}: loss")
        torch.testing.assert_close(record["norm"], expected["norm"], **tolerance, msg=f"{message}: grad norm")
        assert record["losses"].keys() == expected["losses"].keys(), message
        for name, value in record["losses"].items():
            torch.testing.assert_close(value, expected["losses"][name], **tolerance, msg=f"{message}: {name}")


# ---------------------------------------------------------------------------------------------------------------------
# In the spawned ranks


def _train_layout(label: str, model: str, settings: dict, accumulation: int, root: Path, reference: dict) -> Trainer:
    run_config = _run_config(model, root / label, accumulation, **settings)
    trainer = Trainer(run_config, distributed=Distributed(run_config.distributed), log=lambda _: None)
    trainer.run()
    bf16 = settings.get("compute_dtype") == "bf16"
    _assert_same_history(_history(trainer), reference["history"], label, BF16_TOLERANCE if bf16 else LOSS_TOLERANCE)
    zero_stage = settings["zero_stage"]
    for name, parameter in trainer.model.named_parameters():
        expert = parameter.meta.data_parallel_sharded
        assert is_sharded(parameter) == (zero_stage > 0 and not expert), f"{label}: {name} sharding"
        weight = _global(parameter, parameter, trainer.distributed)
        if bf16:  # the update (from the same initial weights) within a fraction of its own size
            update = weight - reference["initial"][name]
            expected = reference["weights"][name] - reference["initial"][name]
            relative = float((update - expected).norm() / expected.norm())
            assert relative < BF16_UPDATE_TOLERANCE, f"{label}: {name} update differs by {relative:.3g} of its size"
        else:
            torch.testing.assert_close(weight, reference["weights"][name], **WEIGHT_TOLERANCE, msg=f"{label}: {name}")
        assert parameter.dtype == torch.float32, f"{label}: {name} master weight"
        moved = (weight - reference["initial"][name]).abs().max()
        if parameter.requires_grad:  # training moved every weight far beyond the tolerance: equal updates
            assert moved > 1e-3, f"{label}: {name} did not train"
        else:
            assert moved == 0, f"{label}: the frozen {name} changed"
    return trainer


def _write_memory(trainer: Trainer, root: Path, label: str) -> None:
    """Every rank's memory figures, for the parent to compare with the single process's."""
    memory = trainer.memory
    path = root / f"{label}.memory.rank{trainer.distributed.rank}.json"
    path.write_text(json.dumps([memory.parameters, memory.gradients, memory.optimizer]))


def _check_layouts(world_size: int, references: dict, root: str) -> None:
    root = Path(root)
    with Distributed(DistributedConfig(seed=SEED, backend="gloo", timeout=120)):
        for label, (model, settings, accumulation) in LAYOUTS[world_size].items():
            trainer = _train_layout(label, model, settings, accumulation, root, references[label])
            if label.endswith("memory"):
                _write_memory(trainer, root, label)
            if label == CHECKPOINT_LAYOUT:
                _check_checkpoints_of_the_layout(trainer, settings, references[label], root)
            dist.barrier()


def _check_checkpoints_of_the_layout(trainer: Trainer, settings: dict, reference: dict, root: Path) -> None:
    """ZeRO 3 × TP 2: its checkpoint holds its state exactly; the single process's checkpoint resumes here exactly
    and trains on as the single process does."""
    distributed = trainer.distributed
    saved = root / CHECKPOINT_LAYOUT / f"step_{STEPS}"
    state = _global_state(trainer)
    if distributed.rank == 0:
        weights, optimizer = load_file(saved / "model.safetensors"), load_file(saved / "optimizer.safetensors")
        assert weights.keys() | optimizer.keys() == state.keys()
        for name, tensor in {**weights, **optimizer}.items():
            assert torch.equal(tensor, state[name]), f"saved {name}"
    # Resuming the single-process checkpoint (a copy: its run directory is the reference's).
    resumed_dir = root / "single-resumed-under-z3-tp2"
    if distributed.rank == 0:
        shutil.copytree(reference["run_dir"] / f"step_{STEPS}", resumed_dir / f"step_{STEPS}")
    dist.barrier()
    run_config = _run_config("transformer", resumed_dir, 1, STEPS + 1, **settings)
    resumed = Trainer(run_config, distributed=Distributed(run_config.distributed), log=lambda _: None)
    assert resumed.step == STEPS
    single_state = {
        **load_file(reference["run_dir"] / f"step_{STEPS}" / "model.safetensors"),
        **load_file(reference["run_dir"] / f"step_{STEPS}" / "optimizer.safetensors"),
    }
    loaded = _global_state(resumed)
    assert loaded.keys() == single_state.keys()
    for name, tensor in loaded.items():
        assert torch.equal(tensor, single_state[name]), f"loaded {name}"
    resumed.run()
    _assert_same_history(_history(resumed), reference["next_step"], "single-process checkpoint resumed under z3×tp2")
    # And this run's own checkpoint, trained one more step here, for the parent to resume on one process.
    run_config = _run_config("transformer", root / CHECKPOINT_LAYOUT, 1, STEPS + 1, **settings)
    if distributed.rank == 0:
        shutil.copytree(saved, root / "z3-tp2-saved" / f"step_{STEPS}")
    going_on = Trainer(run_config, distributed=Distributed(run_config.distributed), log=lambda _: None)
    going_on.run()
    if distributed.rank == 0:
        (root / "z3-tp2-next-step.json").write_text(json.dumps(_history(going_on)))
    final = _global_state(going_on)
    if distributed.rank == 0:
        save_file({name: tensor.contiguous() for name, tensor in final.items()}, root / "z3-tp2-final.safetensors")


# ---------------------------------------------------------------------------------------------------------------------
# In the test process


def _references(world_size: int, root: Path) -> dict:
    runs: dict[tuple[str, int], dict] = {}
    references = {}
    for label, (model, settings, accumulation) in LAYOUTS[world_size].items():
        dtype = settings.get("compute_dtype", "fp32")
        key = (model, accumulation * _data_size(world_size, settings), dtype)
        if key not in runs:
            run_dir = root / f"single-{model}-{key[1]}-{dtype}"
            trainer = _single_process_run(model, key[1], run_dir, compute_dtype=dtype)
            fresh = LanguageModel(trainer.run_config.model, single_process())
            runs[key] = {
                "history": _history(trainer),
                "weights": {name: parameter.detach() for name, parameter in trainer.model.named_parameters()},
                "initial": {name: parameter.detach() for name, parameter in fresh.named_parameters()},
                "memory": trainer.memory,
                "run_dir": run_dir,
            }
        references[label] = runs[key]
    if CHECKPOINT_LAYOUT in references:  # the single-process run's next step, from its checkpoint
        reference = references[CHECKPOINT_LAYOUT]
        resumed = _single_process_run("transformer", 2, reference["run_dir"], STEPS + 1)
        assert resumed.history[0].step == STEPS + 1
        reference["next_step"] = _history(resumed)
    return references


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", LAYOUTS)
def test_zero_stages_match_the_single_process_run(world_size, tmp_path):
    references = _references(world_size, tmp_path)
    run_distributed(world_size, _check_layouts, world_size, references, str(tmp_path))
    label = f"z3-dp{world_size}-memory"
    _check_memory_falls_as_one_over_n(references[label]["memory"], tmp_path, label, world_size)
    if world_size == 4:
        _check_the_zero3_tp2_checkpoint_on_one_process(tmp_path)


def _check_memory_falls_as_one_over_n(single, root: Path, label: str, ranks: int) -> None:
    """Under ZeRO 3 each rank holds its rows of every parameter, gradient and moment: the ranks together hold what
    the single process holds (the step counts excepted: one per parameter on every rank), none more than 1/N of it
    plus FSDP's rounding (ceil(rows / N) rows per tensor)."""
    per_rank = [json.loads((root / f"{label}.memory.rank{rank}.json").read_text()) for rank in range(ranks)]
    parameters, gradients, optimizer = (sum(figures) for figures in zip(*per_rank))
    model = LanguageModel(_run_config("transformer-63", root, 1).model, single_process())
    tensors = list(model.parameters())
    assert parameters == single.parameters and gradients == single.gradients
    assert optimizer == single.optimizer + (ranks - 1) * 4 * len(tensors)  # a step count per tensor on every rank
    # A rank's shard of r rows is ceil(r / N) rows or fewer: within N - 1 rows of r / N.
    rounding = sum(tensor.numel() // tensor.shape[0] * 4 * (ranks - 1) for tensor in tensors)
    for rank, (rank_parameters, rank_gradients, rank_optimizer) in enumerate(per_rank):
        assert abs(rank_parameters - single.parameters / ranks) <= rounding, rank
        assert abs(rank_gradients - single.gradients / ranks) <= rounding, rank
        assert abs(rank_optimizer - single.optimizer / ranks) <= 2 * rounding + 4 * len(tensors), rank


def _check_the_zero3_tp2_checkpoint_on_one_process(root: Path) -> None:
    """The ZeRO 3 × TP 2 checkpoint resumes on one process: the state exactly, the next step as the 4 ranks took it;
    `blockzoo convert` to llama gives the tensors of the single-process export of the same weights, which
    transformers loads and runs as blockzoo does."""
    run_dir = root / "z3-tp2-saved"
    resumed = Trainer(_run_config("transformer", run_dir, 2, STEPS + 1), log=lambda _: None)
    assert resumed.step == STEPS
    saved = {
        **load_file(run_dir / f"step_{STEPS}" / "model.safetensors"),
        **load_file(run_dir / f"step_{STEPS}" / "optimizer.safetensors"),
    }
    loaded = _global_state(resumed)
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[name], saved[name]) for name in saved)
    resumed.run()
    next_step = json.loads((root / "z3-tp2-next-step.json").read_text())
    _assert_same_history(_history(resumed)[-1:], next_step[-1:], "z3×tp2 checkpoint resumed on one process")
    final = load_file(root / "z3-tp2-final.safetensors")
    for name, parameter in resumed.model.named_parameters():
        torch.testing.assert_close(parameter.detach(), final[name], **WEIGHT_TOLERANCE, msg=name)

    converted, exported = root / "converted", root / "exported"
    convert(run_dir / f"step_{STEPS}", converted, format="llama")
    model = blockzoo.load(run_dir / f"step_{STEPS}")
    blockzoo.save(model, exported, format="llama")
    converted_tensors = load_file(converted / "model.safetensors")
    exported_tensors = load_file(exported / "model.safetensors")
    assert converted_tensors.keys() == exported_tensors.keys()
    assert all(torch.equal(converted_tensors[name], exported_tensors[name]) for name in exported_tensors)
    transformers = pytest.importorskip("transformers")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(converted, use_safetensors=True).eval()
    input_ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(input_ids).logits, model(input_ids), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------------
# On a GPU


GPU_TOLERANCE = {"rtol": 1e-3, "atol": 1e-3}  # bf16 compute; both runs do the same operations in the same order


def _gpu_run_config(zero_stage: int, output_dir: Path) -> RunConfig:
    return _run_config("transformer", output_dir, 2, 4, zero_stage=zero_stage, backend="nccl", compute_dtype="bf16")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_zero_3_on_one_gpu_trains_as_zero_0(tmp_path, monkeypatch):
    """FSDP on CUDA (its streams, NCCL, fused AdamW over DTensors) in a world of one NCCL rank: ZeRO 3 trains as
    ZeRO 0 (plain, no FSDP) does. From the second step on, nothing in a step may synchronize the host with the device
    (`torch.cuda.set_sync_debug_mode("error")`) but the step's one read of its figures (`to_host`)."""
    from torch.distributed.tensor import DTensor

    from blockzoo.training.step import to_host
    from blockzoo_testing.distributed import free_port

    plain = Trainer(_gpu_run_config(0, tmp_path / "zero0"), log=lambda _: None)
    plain.run()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        sharded = Trainer(_gpu_run_config(3, tmp_path / "zero3"), log=lambda _: None)
        assert all(isinstance(parameter, DTensor) for parameter in sharded.model.parameters())

        def the_one_read(values):
            torch.cuda.set_sync_debug_mode(0)
            try:
                return to_host(values)
            finally:
                torch.cuda.set_sync_debug_mode("error")

        train_step = sharded._train_step

        def strict_step(*args, **kwargs):  # from the second step: the first one allocates (FSDP, AdamW state)
            torch.cuda.set_sync_debug_mode("error" if sharded.step >= 1 else 0)
            try:
                return train_step(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(0)

        monkeypatch.setattr("blockzoo.training.trainer.to_host", the_one_read)
        sharded._train_step = strict_step
        sharded.run()
    finally:
        dist.destroy_process_group()
    history, expected = _history(sharded), _history(plain)
    for record, reference in zip(history, expected, strict=True):
        torch.testing.assert_close(record["loss"], reference["loss"], **GPU_TOLERANCE)
        torch.testing.assert_close(record["norm"], reference["norm"], **GPU_TOLERANCE)
    weights = {name: parameter.to_local().detach().cpu() for name, parameter in sharded.model.named_parameters()}
    for name, parameter in plain.model.named_parameters():
        torch.testing.assert_close(weights[name], parameter.detach().cpu(), **GPU_TOLERANCE, msg=name)
