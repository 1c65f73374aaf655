"""Native checkpoints: bit-exact round trips of weights and optimizer state, any parallel layout loads any other,
atomic saves, pruning, and a clear refusal for every broken or foreign checkpoint."""

import re
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file, save_file
from torch import nn

import blockzoo.checkpoint
import blockzoo.safetensors_io
from blockzoo import __version__
from blockzoo.api import MLPConfig, configclass, field, hookimpl
from blockzoo.checkpoint import (
    CheckpointError,
    keep_last,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint_config,
    read_origin,
    save_checkpoint,
)
from blockzoo.config import structure, to_dict
from blockzoo.conversion import Origin
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.config import BiasConfig, LinearConfig, NormalInitializationConfig
from blockzoo.layers.dims import ConcatenatedTensorDim, TensorDim
from blockzoo.layers.linear import Linear
from blockzoo.model.config import ModelConfig
from blockzoo.plugins import register_plugin, reset_registry
from blockzoo_testing.distributed import run_distributed

HIDDEN, INTERMEDIATE = 8, 12
EMPTY_BLOCK = {"mixer": {"type": "none"}, "mlp": {"type": "none"}}
FILES = {"config.yaml", "metadata.yaml", "model.safetensors", "optimizer.safetensors"}


class TinyModel(nn.Module):
    """A column-parallel gate‖up with biases, a row-parallel down, a replicated readout, and a tied alias of it."""

    def __init__(self, distributed: Distributed, hidden: int = HIDDEN, extra: bool = False):
        super().__init__()
        self.tp_size = distributed.tensor_size
        init = NormalInitializationConfig(std=0.3)
        biased = LinearConfig(bias=BiasConfig(enabled=True, initialization=init))
        hidden_dim = TensorDim("hidden", hidden)
        self.intermediate = TensorDim("intermediate", INTERMEDIATE, parallel=True)
        gate_up = ConcatenatedTensorDim(
            "gate_up", [TensorDim("gate", INTERMEDIATE, parallel=True), TensorDim("up", INTERMEDIATE, parallel=True)]
        )
        common = {"default_initialization": init}
        self.gate_up = Linear("gate_up", [biased, biased], hidden_dim, gate_up, distributed, **common)
        self.down = Linear("down", biased, self.intermediate, hidden_dim, distributed, **common)
        self.readout = Linear("readout", biased, hidden_dim, hidden_dim, distributed, **common)
        self.tied = self.readout  # The same parameters under a second name: saved once.
        if extra:
            self.extra = Linear("extra", LinearConfig(), hidden_dim, hidden_dim, distributed, **common)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(input).split(self.intermediate.local_size(self.tp_size), dim=-1)
        return self.readout(self.down(F.silu(gate) * up))


def single(seed: int = 1) -> Distributed:
    return Distributed(DistributedConfig(seed=seed), world_size=1, rank=0, local_rank=0)


def trained(distributed: Distributed, steps: int = 2, **kwargs) -> tuple[TinyModel, torch.optim.AdamW]:
    model = TinyModel(distributed, **kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    train(model, optimizer, steps)
    return model, optimizer


def train(model: TinyModel, optimizer: torch.optim.Optimizer, steps: int) -> None:
    generator = torch.Generator().manual_seed(0)
    device = model.down.weight.device
    for _ in range(steps):
        (model(torch.randn(5, HIDDEN, generator=generator).to(device)) ** 2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def run_config() -> ModelConfig:
    """The config saved with the checkpoint. Checkpoints take any config; a model config keeps these tests
    independent of the rest of the run config (its data and training sections come from other plugins)."""
    return structure({"hidden_size": HIDDEN, "decoder": {"block": EMPTY_BLOCK}}, ModelConfig)


def save(directory: Path, model: TinyModel, optimizer=None, step: int = 2, **kwargs) -> Path:
    return save_checkpoint(
        directory, model=model, optimizer=optimizer, run_config=run_config(), step=step, distributed=single(), **kwargs
    )


def assert_same_state(model: TinyModel, optimizer, other: TinyModel, other_optimizer) -> None:
    for (name, parameter), other_parameter in zip(model.named_parameters(), other.parameters(), strict=True):
        assert torch.equal(parameter, other_parameter), name
        state, other_state = optimizer.state[parameter], other_optimizer.state[other_parameter]
        assert state.keys() == other_state.keys() == {"step", "exp_avg", "exp_avg_sq"}, name
        for key in state:
            assert torch.equal(state[key], other_state[key]), f"{name}/{key}"


# ---------------------------------------------------------------------------------------------------------------------
# Round trips


def test_round_trip_is_bit_exact(tmp_path):
    model, optimizer = trained(single(seed=1))
    rng = {"cpu": torch.get_rng_state().tolist(), "python": b"\x00\x01state"}
    save(tmp_path / "step_2", model, optimizer, data_state={"epoch": 1, "offset": 1234}, extra={"rng": rng})
    assert {path.name for path in (tmp_path / "step_2").iterdir()} == FILES
    assert {path.name for path in tmp_path.iterdir()} == {"step_2"}  # No temporary left behind.

    other = TinyModel(single(seed=2))
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=0.05)
    assert not torch.equal(other.down.weight, model.down.weight)
    config, metadata = load_checkpoint(
        tmp_path / "step_2", model=other, optimizer=other_optimizer, distributed=single()
    )
    assert_same_state(model, optimizer, other, other_optimizer)
    assert other.tied is other.readout  # Tied parameters stay tied.
    # Both continue identically: the loaded state is the one training uses.
    train(model, optimizer, 1)
    train(other, other_optimizer, 1)
    assert_same_state(model, optimizer, other, other_optimizer)

    assert structure(config, ModelConfig) == run_config() and config == to_dict(run_config())
    assert read_checkpoint_config(tmp_path / "step_2") == config
    assert metadata["step"] == 2 and metadata["format_version"] == 1 and metadata["blockzoo_version"] == __version__
    assert metadata["data"] == {"epoch": 1, "offset": 1234} and metadata["extra"] == {"rng": rng}
    assert metadata["plugins"] == {
        "blockzoo": {
            "distribution": "blockzoo",
            "version": __version__,
            "types": ["block:decoder", "block_sequence:fixed", "mixer:none", "mlp:none", "normalization:rms_norm"],
        }
    }


def test_tensors_are_global_and_saved_once(tmp_path):
    model, optimizer = trained(single())
    save(tmp_path / "step_2", model, optimizer)
    weights = load_file(tmp_path / "step_2" / "model.safetensors")
    assert weights.keys() == {
        f"{layer}.{kind}" for layer in ("gate_up", "down", "readout") for kind in ("weight", "bias")
    }
    assert weights["gate_up.weight"].shape == (2 * INTERMEDIATE, HIDDEN)
    states = load_file(tmp_path / "step_2" / "optimizer.safetensors")
    assert states.keys() == {f"{name}/{key}" for name in weights for key in ("step", "exp_avg", "exp_avg_sq")}
    assert states["down.weight/step"].item() == 2.0


def test_a_checkpoint_without_optimizer_state_loads_the_weights(tmp_path):
    model, _ = trained(single(seed=1))
    save(tmp_path / "weights", model)
    assert not (tmp_path / "weights" / "optimizer.safetensors").exists()
    other = TinyModel(single(seed=2))
    load_checkpoint(tmp_path / "weights", model=other, distributed=single())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters(), strict=True))
    with pytest.raises(CheckpointError, match=r"optimizer.safetensors: this checkpoint was saved without optimizer"):
        load_checkpoint(
            tmp_path / "weights", model=other, optimizer=torch.optim.AdamW(other.parameters()), distributed=single()
        )


def test_optimizer_state_that_is_not_per_parameter_is_refused(tmp_path):
    model, optimizer = trained(single())
    optimizer.state[model.down.weight]["rows"] = torch.zeros(3)
    with pytest.raises(CheckpointError, match=r"state 'rows' of parameter 'down.weight' is a tensor of shape \(3,\)"):
        save(tmp_path / "step_2", model, optimizer)
    assert not any(tmp_path.iterdir())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_round_trip(tmp_path):
    on_gpu = Distributed(DistributedConfig(seed=1, backend="nccl"), world_size=1, rank=0, local_rank=0)
    model, optimizer = trained(on_gpu)
    save_checkpoint(
        tmp_path / "gpu", model=model, optimizer=optimizer, run_config=run_config(), step=2, distributed=on_gpu
    )
    # On the CPU, then back on the GPU: the same values, and the state where the optimizer keeps it.
    cpu_model = TinyModel(single(seed=2))
    cpu_optimizer = torch.optim.AdamW(cpu_model.parameters(), lr=0.05)
    load_checkpoint(tmp_path / "gpu", model=cpu_model, optimizer=cpu_optimizer, distributed=single())
    save(tmp_path / "cpu", cpu_model, cpu_optimizer)
    gpu_model = TinyModel(Distributed(DistributedConfig(seed=3, backend="nccl"), world_size=1, rank=0, local_rank=0))
    gpu_optimizer = torch.optim.AdamW(gpu_model.parameters(), lr=0.05)
    load_checkpoint(tmp_path / "cpu", model=gpu_model, optimizer=gpu_optimizer, distributed=on_gpu)
    assert_same_state(model, optimizer, gpu_model, gpu_optimizer)
    state = gpu_optimizer.state[gpu_model.down.weight]
    assert state["exp_avg"].is_cuda and gpu_model.down.weight.is_cuda
    train(model, optimizer, 1)
    train(gpu_model, gpu_optimizer, 1)
    assert_same_state(model, optimizer, gpu_model, gpu_optimizer)


# ---------------------------------------------------------------------------------------------------------------------
# Plugins


@configclass
class WideMLPConfig(MLPConfig):
    width: int = field(4, doc="A field.")


@hookimpl
def _register_mlps(register):
    register("ckpt.wide", WideMLPConfig)


def test_plugins_the_config_uses_are_recorded_and_required(tmp_path, fresh_registry):
    register_plugin(types.SimpleNamespace(register_mlps=_register_mlps), "ckpt")
    config = structure({"decoder": {"block": {"mixer": {"type": "none"}, "mlp": {"type": "ckpt.wide"}}}}, ModelConfig)
    model = TinyModel(single())
    save_checkpoint(tmp_path / "step_1", model=model, run_config=config, step=1, distributed=single())
    plugins = yaml.safe_load((tmp_path / "step_1" / "metadata.yaml").read_text())["plugins"]
    assert plugins["ckpt"] == {"distribution": None, "version": None, "types": ["mlp:ckpt.wide"]}
    assert "mlp:ckpt.wide" not in plugins["blockzoo"]["types"]
    reset_registry()  # The plugin is gone.
    with pytest.raises(
        CheckpointError, match=r"metadata.yaml: the checkpoint needs plugin 'ckpt', which is not installed"
    ):
        load_checkpoint(tmp_path / "step_1", model=model, distributed=single())


# ---------------------------------------------------------------------------------------------------------------------
# Any layout loads any other


def _parallel_cases(root: str) -> None:
    root = Path(root)
    with Distributed(DistributedConfig(seed=1, tensor_parallel=2, backend="gloo", timeout=60)) as distributed:
        group = distributed.tensor_group

        def global_state(model, optimizer):
            # Gathered from the tensor-parallel shards (a collective: both ranks call it).
            return [
                (
                    p.meta.local_to_global(p.detach(), group),
                    {k: p.meta.local_to_global(v, group) if v.ndim else v for k, v in optimizer.state[p].items()},
                )
                for p in model.parameters()
            ]

        def single_state(model, optimizer):
            return [(p.detach(), dict(optimizer.state[p])) for p in model.parameters()]

        def assert_equal(state, other, label):
            for (tensor, optimizer_state), (other_tensor, other_optimizer_state) in zip(state, other, strict=True):
                assert torch.equal(tensor, other_tensor), label
                assert optimizer_state.keys() == other_optimizer_state.keys(), label
                for key in optimizer_state:
                    assert torch.equal(optimizer_state[key], other_optimizer_state[key]), f"{label}: {key}"

        # Saved with tensor-parallel 2, loaded by one process.
        parallel, parallel_optimizer = trained(distributed)
        save_checkpoint(
            root / "tp2",
            model=parallel,
            optimizer=parallel_optimizer,
            run_config=run_config(),
            step=2,
            distributed=distributed,
        )
        loaded = TinyModel(single(seed=7))
        loaded_optimizer = torch.optim.AdamW(loaded.parameters(), lr=0.05)
        load_checkpoint(root / "tp2", model=loaded, optimizer=loaded_optimizer, distributed=single())
        assert_equal(global_state(parallel, parallel_optimizer), single_state(loaded, loaded_optimizer), "TP2 → 1")

        # Saved by one process, loaded with tensor-parallel 2.
        reference, reference_optimizer = trained(single(seed=3))
        if distributed.rank == 0:
            save_checkpoint(
                root / "single",
                model=reference,
                optimizer=reference_optimizer,
                run_config=run_config(),
                step=2,
                distributed=single(),
            )
        dist.barrier()
        target = TinyModel(distributed)
        target_optimizer = torch.optim.AdamW(target.parameters(), lr=0.05)
        load_checkpoint(root / "single", model=target, optimizer=target_optimizer, distributed=distributed)
        for parameter, expected in zip(target.parameters(), reference.parameters(), strict=True):
            assert torch.equal(parameter, parameter.meta.global_to_local(expected, distributed.tensor_rank, 2))
        assert_equal(global_state(target, target_optimizer), single_state(reference, reference_optimizer), "1 → TP2")
        # Training goes on as it would have on one process.
        train(reference, reference_optimizer, 1)
        train(target, target_optimizer, 1)
        for parameter, expected in zip(target.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(parameter.meta.local_to_global(parameter.detach(), group), expected.detach())


@pytest.mark.distributed
def test_any_parallel_layout_loads_any_other(tmp_path):
    run_distributed(2, _parallel_cases, str(tmp_path))


# ---------------------------------------------------------------------------------------------------------------------
# Atomic saves, finding and pruning


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "model.safetensors")


def test_a_failed_save_leaves_the_last_checkpoint(tmp_path, monkeypatch):
    model, optimizer = trained(single(seed=1))
    save(tmp_path / "step_1", model, optimizer, step=1)
    good = _weights(tmp_path / "step_1")

    def disk_full(writer, name, tensor):  # Part of a file is written, then the failure.
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(blockzoo.safetensors_io.SafetensorsWriter, "write", disk_full)
    train(model, optimizer, 1)
    # A full disk is a CheckpointError naming the directory and the space needed (blockzoo.checkpoint: no traceback).
    with pytest.raises(CheckpointError, match=r"step_2: the disk filled up while saving: it needs about [\d.]+ MiB"):
        save(tmp_path / "step_2", model, optimizer, step=2)
    with pytest.raises(CheckpointError, match="the disk filled up"):  # Replacing a checkpoint fails the same way.
        save(tmp_path / "step_1", model, optimizer, step=1)
    assert [path.name for path in tmp_path.iterdir()] == ["step_1"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_1"
    assert all(torch.equal(good[name], tensor) for name, tensor in _weights(tmp_path / "step_1").items())
    load_checkpoint(tmp_path / "step_1", model=TinyModel(single()), optimizer=None, distributed=single())

    # A process killed mid-save leaves its temporary directory: never taken for a checkpoint, removed by the next save.
    monkeypatch.undo()
    (tmp_path / ".step_3.partial").mkdir()
    (tmp_path / ".step_3.partial" / "model.safetensors").write_bytes(b"\x00")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_1"
    save(tmp_path / "step_3", model, optimizer, step=3)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step_1", "step_3"]


def test_saving_over_a_checkpoint_replaces_it(tmp_path):
    first, _ = trained(single(seed=1))
    second, _ = trained(single(seed=2))
    save(tmp_path / "step_1", first)
    save(tmp_path / "step_1", second)
    assert [path.name for path in tmp_path.iterdir()] == ["step_1"]
    assert torch.equal(_weights(tmp_path / "step_1")["down.weight"], second.down.weight.detach())
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match=r"notes: exists and is not a checkpoint; refusing to replace it"):
        save(tmp_path / "notes", first)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


def _origin(directory: Path) -> Origin:
    """The files of a checkpoint of another format, as a converter plugin names them."""
    directory.mkdir()
    (directory / "config.json").write_text('{"eos_token_id": 2}')
    (directory / "tokenizer.json").write_bytes(b'{"model": "\xc3\xa9"}')
    (directory / "model.safetensors").write_bytes(b"weights: never kept")
    return Origin(directory, ("config.json", "tokenizer.json"))


def test_a_checkpoint_keeps_the_origin_files_of_its_model(tmp_path):
    model, optimizer = trained(single())
    origin = _origin(tmp_path / "hf")
    save(tmp_path / "step_2", model, optimizer, origin=origin)
    kept = read_origin(tmp_path / "step_2")
    assert kept == Origin(tmp_path / "step_2" / "origin", ("config.json", "tokenizer.json"))
    assert sorted(path.name for path in kept.directory.iterdir()) == ["config.json", "tokenizer.json"]
    for path, original in zip(kept.paths(), origin.paths(), strict=True):
        assert path.read_bytes() == original.read_bytes()
    # Saved again from its own copies (a resumed run replacing its checkpoint), and gone once the files are.
    save(tmp_path / "step_2", model, optimizer, origin=kept)
    assert (tmp_path / "step_2" / "origin" / "tokenizer.json").read_bytes() == b'{"model": "\xc3\xa9"}'
    save(tmp_path / "step_3", model, optimizer)
    assert read_origin(tmp_path / "step_3") is None and not (tmp_path / "step_3" / "origin").exists()


def test_origin_files_that_are_gone_fail_the_save_and_the_load(tmp_path):
    model, optimizer = trained(single())
    origin = _origin(tmp_path / "hf")
    save(tmp_path / "step_2", model, optimizer, origin=origin)
    (origin.directory / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"hf/tokenizer.json: is gone: the model's origin files are needed"):
        save(tmp_path / "step_2", model, optimizer, origin=origin)
    assert read_origin(tmp_path / "step_2") is not None  # the checkpoint that was there is intact
    (tmp_path / "step_2" / "origin" / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"origin/config.json: missing: the checkpoint lists it"):
        load_checkpoint(tmp_path / "step_2", model=TinyModel(single()), distributed=single())


def test_latest_and_keep_last(tmp_path):
    model = TinyModel(single())
    assert latest_checkpoint(tmp_path / "nothing") is None
    for step in (1, 2, 10):
        save(tmp_path / f"step_{step}", model, step=step)
    (tmp_path / "step_20").mkdir()  # Not a checkpoint (no metadata): ignored.
    (tmp_path / "step_x").mkdir()
    (tmp_path / "other").mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_10"  # By number, not by name.
    assert keep_last(tmp_path, 2) == [tmp_path / "step_1"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["other", "step_10", "step_2", "step_20", "step_x"]
    assert keep_last(tmp_path, 2) == []
    with pytest.raises(ValueError, match="count must be >= 1, got 0"):
        keep_last(tmp_path, 0)


def test_trainer_state_must_be_plain_data(tmp_path):
    with pytest.raises(ValueError, match=r"must be plain data"):
        save(tmp_path / "step_1", TinyModel(single()), extra={"rng": torch.Generator()})
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------------------------------
# Refusals


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    model, optimizer = trained(single())
    return save(tmp_path_factory.mktemp("saved") / "step_2", model, optimizer)


@pytest.fixture
def broken(checkpoint, tmp_path) -> Path:
    """A copy of the checkpoint that the test may break, without its checksums (as written before they were
    recorded: these tests reach the checks behind them; test_checkpoint_reliability.py tests the checksums)."""
    copy = tmp_path / "step_2"
    copy.mkdir()
    for path in checkpoint.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    metadata = yaml.safe_load((copy / "metadata.yaml").read_text())
    del metadata["checksums"]
    (copy / "metadata.yaml").write_text(yaml.safe_dump(metadata))
    return copy


def edit_metadata(directory: Path, **changes) -> None:
    path = directory / "metadata.yaml"
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), **changes}))


def refusal(directory: Path, *, model=None, with_optimizer: bool = False) -> CheckpointError:
    model = model or TinyModel(single(seed=9))
    optimizer = torch.optim.AdamW(model.parameters()) if with_optimizer else None
    before = [parameter.detach().clone() for parameter in model.parameters()]
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(directory, model=model, optimizer=optimizer, distributed=single())
    # A refused checkpoint changes nothing.
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert optimizer is None or not optimizer.state
    return caught.value


def test_missing_directory_and_files(broken, tmp_path):
    error = refusal(tmp_path / "step_99")
    assert error.path == tmp_path / "step_99" and "no such checkpoint directory" in str(error)
    for name in ("model.safetensors", "optimizer.safetensors", "config.yaml", "metadata.yaml"):
        copy = tmp_path / f"without_{name}"
        copy.mkdir()
        for path in broken.iterdir():
            if path.name != name:
                (copy / path.name).write_bytes(path.read_bytes())
        error = refusal(copy, with_optimizer=True)
        assert error.path == copy / name and "missing" in error.problem, name
    with pytest.raises(CheckpointError, match=r"config.yaml: missing"):
        read_checkpoint_config(tmp_path / "without_config.yaml")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"format_version": 2},
            r"checkpoint format version 2 is unknown to blockzoo .* \(it reads format 1 and older\)",
        ),
        ({"format_version": "two"}, r"`format_version` is missing or not a int: 'two'"),
        ({"format_version": None}, r"`format_version` is missing"),
        ({"blockzoo_version": "1.0.0"}, r"written by blockzoo 1.0.0, a newer major version than this blockzoo"),
        ({"blockzoo_version": "banana"}, r"unknown blockzoo version 'banana'"),
        ({"step": "2"}, r"`step` is missing or not a int"),
        (
            {
                "plugins": {
                    "acme": {"distribution": "blockzoo-test-acme", "version": "0.3.1", "types": ["mixer:acme.shift"]}
                }
            },
            r"needs plugin 'acme' \(blockzoo-test-acme 0.3.1\), which is not installed "
            r"\(it provides: mixer:acme.shift\)",
        ),
    ],
)
def test_refuses_foreign_metadata(broken, changes, message):
    edit_metadata(broken, **changes)
    error = refusal(broken)
    assert error.path == broken / "metadata.yaml" and re.search(message, error.problem)
    with pytest.raises(CheckpointError, match=message):
        read_checkpoint_config(broken)


def test_refuses_unreadable_metadata(broken):
    (broken / "metadata.yaml").write_text("format_version: [1\n")
    assert "cannot be read" in refusal(broken).problem
    (broken / "metadata.yaml").write_text("- a list\n")
    assert "expected a mapping, found list" in refusal(broken).problem


@pytest.mark.parametrize("damage", ["truncated", "garbage header"])
@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors"])
def test_refuses_corrupted_tensor_files(broken, damage, name):
    path = broken / name
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\xff" * 16 + data[16:])
    error = refusal(broken, with_optimizer=True)
    assert error.path == path and error.problem.startswith("not a readable safetensors file (")
    assert error.problem.endswith("): corrupted or rewritten since the checkpoint was saved")


def test_refuses_missing_and_misshapen_tensors(broken):
    error = refusal(broken, model=TinyModel(single(), extra=True))
    assert error.path == broken / "model.safetensors"
    assert error.problem == "tensor 'extra.weight' is missing"
    error = refusal(broken, model=TinyModel(single(), hidden=2 * HIDDEN))
    assert error.problem == (
        "tensor 'gate_up.weight' has shape [24, 8], but the model expects [24, 16]: the two disagree (an architecture "
        "field changed?)"
    )

    # Weights of a parameter the model does not have.
    weights = load_file(broken / "model.safetensors")
    save_file({**weights, "lost.weight": torch.zeros(2)}, broken / "model.safetensors")
    assert refusal(broken).problem == "the model has no parameter 'lost.weight' that the file holds"
    save_file(weights, broken / "model.safetensors")

    # Optimizer state: one tensor missing, one of the wrong shape.
    states = load_file(broken / "optimizer.safetensors")
    optimizer_file = broken / "optimizer.safetensors"
    save_file({k: v for k, v in states.items() if k != "down.weight/exp_avg_sq"}, optimizer_file)
    error = refusal(broken, with_optimizer=True)
    assert error.path == optimizer_file and error.problem.startswith("tensor down.weight/exp_avg_sq is missing")
    save_file({**states, "down.weight/exp_avg": torch.zeros(3, 3)}, optimizer_file)
    error = refusal(broken, with_optimizer=True)
    assert error.problem.startswith(
        "tensor 'down.weight/exp_avg' has shape [3, 3], expected [] or the parameter's [8, 12]"
    )
    save_file({**states, "ghost/step": torch.tensor(1.0)}, optimizer_file)
    error = refusal(broken, with_optimizer=True)
    assert "'ghost', which is not a parameter of the model" in error.problem
