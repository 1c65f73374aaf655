"""Checkpoints under hostile conditions: a full disk, stop signals, interrupted pruning, a
corrupted or edited latest checkpoint, silent corruption, exact random states, non-finite weights and logits; and a
kill test (SIGKILL at random moments during saves and pruning)."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from test_training import BASE, configure, quiet, train, weights, write_config

import blockzoo
import blockzoo.checkpoint
import blockzoo.checkpoint.checksums
import blockzoo.checkpoint.gather
import blockzoo.checkpoint.retention
import blockzoo.checkpoint.space
import blockzoo.safetensors_io
from blockzoo import cli
from blockzoo.checkpoint import CheckpointError, keep_last, latest_checkpoint, verify_checkpoint
from blockzoo.errors import UsageError
from blockzoo.training.trainer import Stopped, Trainer, TrainingError

Usage = namedtuple("Usage", "total used free")


def run_dirs(root: Path) -> list[str]:
    return sorted(path.name for path in root.iterdir() if path.name != "metrics.jsonl")  # (the run's metrics file)


def flip_a_tensor_byte(path: Path) -> None:
    """Flip one byte in the tensor data (after the header): the file stays a valid safetensors file."""
    data = bytearray(path.read_bytes())
    header = int.from_bytes(data[:8], "little")
    data[8 + header + (len(data) - 8 - header) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def files_size(root: Path) -> int:
    return sum(path.stat().st_size for path in root.rglob("*") if path.is_file())


# ---------------------------------------------------------------------------------------------------------------------
# 6. A full disk


def simulate_disk(monkeypatch, root: Path, capacity: int) -> None:
    """`shutil.disk_usage` as on a disk of `capacity` bytes holding only `root`'s files."""
    monkeypatch.setattr(
        blockzoo.checkpoint.space.shutil,
        "disk_usage",
        lambda _: Usage(capacity, files_size(root), capacity - files_size(root)),
    )


def checkpoint_bytes(tmp_path: Path) -> int:
    """The bytes one checkpoint of the base run takes (measured on a real one)."""
    train(configure(tmp_path / "measure", "training.train_iters=1"))
    return files_size(tmp_path / "measure" / "step_1")


def test_a_nearly_full_disk_prunes_early_and_keeps_saving(tmp_path, monkeypatch):
    size = checkpoint_bytes(tmp_path)
    root = tmp_path / "run"
    root.mkdir()
    # Room for two checkpoints (and the margin the estimate adds): pruning after each save would need three.
    simulate_disk(monkeypatch, root, 2 * size + blockzoo.checkpoint.space._SPACE_MARGIN + size // 2)
    messages = []
    overrides = ["training.train_iters=5", "training.checkpoint_interval=1", "training.checkpoint_keep=2"]
    _, history = train(configure(root, *overrides), log=messages.append)
    assert len(history) == 5 and run_dirs(root) == ["step_4", "step_5"]
    early = [message for message in messages if message.startswith("pruned")]
    assert [message.split()[1] for message in early] == [str(root / f"step_{step}") for step in (1, 2, 3)]
    for step in (4, 5):
        verify_checkpoint(root / f"step_{step}")


def test_too_little_space_is_a_clean_error_naming_the_directory_and_the_space(tmp_path, monkeypatch, capsys):
    size = checkpoint_bytes(tmp_path)
    path = write_config(tmp_path)
    root = tmp_path / "run"
    root.mkdir()
    simulate_disk(monkeypatch, root, 2 * size + blockzoo.checkpoint.space._SPACE_MARGIN + size // 2)
    # checkpoint_keep=3 needs room for three: the third save fails, the first two stay.
    arguments = ["train", str(path), "training.train_iters=5", "training.checkpoint_interval=1"]
    assert cli.main([*arguments, "training.checkpoint_keep=3"]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"blockzoo: error: {root / 'step_3'}: not enough disk space to save the checkpoint: it ")
    assert "needs about" in error and "MiB are free on the file system of" in error and "Traceback" not in error
    assert run_dirs(root) == ["step_1", "step_2"]
    verify_checkpoint(root / "step_2")


def test_a_disk_that_fills_up_while_writing_is_a_clean_error(tmp_path, monkeypatch, capsys):
    def disk_full(writer, name, tensor):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(blockzoo.safetensors_io.SafetensorsWriter, "write", disk_full)
    assert cli.main(["train", str(write_config(tmp_path)), "training.train_iters=1"]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"blockzoo: error: {tmp_path / 'run' / 'step_1'}: the disk filled up while saving: it")
    assert "Traceback" not in error and run_dirs(tmp_path / "run") == []


@pytest.fixture
def tmpfs(tmp_path):
    """A small tmpfs (skipped where it cannot be mounted: not root, no CAP_SYS_ADMIN)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()

    def mount_with(size: int) -> Path:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        return mount

    yield mount_with
    subprocess.run(["umount", str(mount)], capture_output=True)


@pytest.mark.skipif(shutil.which("mount") is None, reason="no mount command")
def test_a_small_tmpfs_keeps_the_run_saving_then_fails_cleanly(tmp_path, tmpfs, monkeypatch):
    # Room for two checkpoints (each file in whole 4 KiB pages), the margin, and a quarter of a third.
    train(configure(tmp_path / "measure", "training.train_iters=1"))
    files = [path.stat().st_size for path in (tmp_path / "measure" / "step_1").iterdir()]
    size = sum(-(-file // 4096) * 4096 for file in files)
    mount = tmpfs(-(-(2 * size + blockzoo.checkpoint.space._SPACE_MARGIN + size // 4) // 4096) * 4096)
    overrides = ["training.train_iters=4", "training.checkpoint_interval=1"]
    _, history = train(configure(mount / "keep2", *overrides, "training.checkpoint_keep=2"))
    assert len(history) == 4 and run_dirs(mount / "keep2") == ["step_3", "step_4"]
    shutil.rmtree(mount / "keep2")
    with pytest.raises(CheckpointError, match=r"step_3: not enough disk space to save the checkpoint: it needs about"):
        train(configure(mount / "keep3", *overrides, "training.checkpoint_keep=3"))
    assert run_dirs(mount / "keep3") == ["step_1", "step_2"]
    # Without the estimate (as if something else filled the disk meanwhile), the writer meets the real ENOSPC.
    monkeypatch.setattr(blockzoo.checkpoint.space, "_SPACE_MARGIN", -(2**40))
    (mount / "filler").write_bytes(b"\0" * (shutil.disk_usage(mount).free - size // 2))
    with pytest.raises(CheckpointError, match=r"step_3: the disk filled up while saving"):
        train(configure(mount / "keep3", *overrides, "training.checkpoint_keep=3"))
    assert run_dirs(mount / "keep3") == ["step_1", "step_2"]  # the partial directory is gone
    verify_checkpoint(mount / "keep3" / "step_2")


# ---------------------------------------------------------------------------------------------------------------------
# 7. SIGTERM / SIGINT


def signal_at(step_line: str, signals: int, *, during_save: bool = False, monkeypatch=None):
    """A log function that sends this process SIGTERM when the run logs `step_line` (`signals` times; with
    `during_save`, the second one while the next checkpoint's tensors are written)."""
    sent = []

    def log(message: str) -> None:
        if message.startswith(step_line) and not sent:
            sent.append(True)
            signal.raise_signal(signal.SIGTERM)
            if signals == 2 and not during_save:
                signal.raise_signal(signal.SIGTERM)

    if during_save:
        write = blockzoo.safetensors_io.SafetensorsWriter.write

        def write_then_signal(writer, name, tensor):
            if sent and len(sent) == 1:
                sent.append(True)
                signal.raise_signal(signal.SIGTERM)
            return write(writer, name, tensor)

        monkeypatch.setattr(blockzoo.safetensors_io.SafetensorsWriter, "write", write_then_signal)
    return log


def test_a_stop_signal_saves_at_the_step_boundary_and_the_run_resumes_exactly(tmp_path):
    overrides = ["training.train_iters=4", "training.checkpoint_interval=100"]
    _, straight = train(configure(tmp_path / "straight", *overrides))
    config = configure(tmp_path / "stopped", *overrides)
    messages = []
    log = signal_at("step 2/4", 1)
    trainer = Trainer(config, log=lambda message: (messages.append(message), log(message)))
    first_half = trainer.run()
    assert [record.step for record in first_half] == [1, 2]
    assert any(
        message.startswith("received SIGTERM: saving a checkpoint at the end of this step") for message in messages
    )
    step_2 = tmp_path / "stopped" / "step_2"
    assert f"stopped at step 2 on a signal; checkpoint {step_2} saved: the run resumes there" in messages
    assert run_dirs(tmp_path / "stopped") == ["step_2"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are given back
    _, second_half = train(config)
    assert [record.loss for record in first_half + second_half] == [record.loss for record in straight]


def test_a_second_signal_stops_at_once_leaving_no_partial_checkpoint(tmp_path, monkeypatch):
    config = configure(tmp_path, "training.train_iters=4", "training.checkpoint_interval=1")
    trainer = Trainer(config, log=signal_at("step 2/4", 2, during_save=True, monkeypatch=monkeypatch))
    with pytest.raises(Stopped) as caught:
        trainer.run()
    assert (
        str(caught.value)
        == f"stopped at once by a second SIGTERM; the last checkpoint ({tmp_path / 'step_1'}) is intact"
    )
    assert caught.value.exit_code == 128 + signal.SIGTERM
    assert run_dirs(tmp_path) == ["step_1"]  # step_2's save was under way: its .partial directory is removed
    verify_checkpoint(tmp_path / "step_1")


def test_the_train_command_exits_0_after_a_sigterm(tmp_path):
    path = write_config(tmp_path)
    command = [sys.executable, "-m", "blockzoo", "train", str(path), "training.train_iters=100000"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in process.stdout:
        if line.startswith("step 2/"):  # the step's log line
            break
    process.send_signal(signal.SIGTERM)
    out, error = process.communicate(timeout=120)
    assert process.returncode == 0, error
    assert "Traceback" not in error
    assert "received SIGTERM" in out and "saved: the run resumes there" in out
    assert not list((tmp_path / "run").glob(".*")), "a hidden .partial / .deleting directory was left"
    verify_checkpoint(latest_checkpoint(tmp_path / "run"))


def test_the_train_command_exits_128_plus_the_signal_after_a_second_one(tmp_path, monkeypatch, capsys):
    def stopped(trainer):
        raise Stopped(signal.SIGINT, "stopped at once by a second SIGINT; no checkpoint was written")

    monkeypatch.setattr(Trainer, "run", stopped)
    assert cli.main(["train", str(write_config(tmp_path))]) == 128 + signal.SIGINT
    assert capsys.readouterr().err == "blockzoo: error: stopped at once by a second SIGINT; no checkpoint was written\n"


# ---------------------------------------------------------------------------------------------------------------------
# 8. Interrupted pruning


def test_interrupted_pruning_never_leaves_a_directory_that_looks_complete(tmp_path, monkeypatch):
    train(configure(tmp_path, "training.train_iters=3", "training.checkpoint_interval=1", "training.checkpoint_keep=3"))
    remove = shutil.rmtree

    def interrupted(path, *args, **kwargs):  # a kill after the metadata went, before the weights
        (Path(path) / "model.safetensors").unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(blockzoo.checkpoint.retention.shutil, "rmtree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        keep_last(tmp_path, 1)
    monkeypatch.setattr(blockzoo.checkpoint.retention.shutil, "rmtree", remove)
    assert run_dirs(tmp_path) == [".step_1.deleting", "step_2", "step_3"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_3"
    assert keep_last(tmp_path, 1) == [tmp_path / "step_2"]
    assert run_dirs(tmp_path) == ["step_3"]  # the leftover is removed too


def test_an_interrupted_replacement_puts_the_previous_checkpoint_back(copy, monkeypatch):
    model = blockzoo.load(copy)  # saved over step_1 (as after a fallback), interrupted between the two renames
    rename = Path.rename

    def interrupted(self, target):
        if self.name == ".step_1.partial":
            raise KeyboardInterrupt
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", interrupted)
    with pytest.raises(KeyboardInterrupt):
        blockzoo.save(model, copy, overwrite=True)
    monkeypatch.undo()
    assert run_dirs(copy.parent) == ["step_1"]
    verify_checkpoint(copy)


# ---------------------------------------------------------------------------------------------------------------------
# 9. A corrupted latest checkpoint, a step directory that is not a checkpoint


def test_resume_and_load_fall_back_to_the_newest_valid_checkpoint(tmp_path, capsys):
    overrides = ["training.train_iters=4", "training.checkpoint_interval=1", "training.checkpoint_keep=4"]
    straight, _ = train(configure(tmp_path / "straight", *overrides))
    root = tmp_path / "run"
    train(configure(root, *overrides[:1], "training.train_iters=3", *overrides[1:]))
    flip_a_tensor_byte(root / "step_3" / "model.safetensors")

    loaded = blockzoo.load(root)  # what `blockzoo generate RUN_DIR` loads
    error = capsys.readouterr().err
    assert (
        f"blockzoo: skipped checkpoint {root / 'step_3'}: {root / 'step_3' / 'model.safetensors'}: corrupted" in error
    )
    step_2 = blockzoo.load(root / "step_2")
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), step_2.parameters(), strict=True))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupted or rewritten since the checkpoint"):
        blockzoo.load(root / "step_3")  # named directly: refused

    messages = []
    resumed, _ = train(configure(root, *overrides), log=messages.append)
    assert any(message.startswith(f"skipped checkpoint {root / 'step_3'}: ") for message in messages)
    assert f"resumed from {root / 'step_2'} (step 2)" in messages
    final = weights(straight.model)
    assert all(torch.equal(final[name], value) for name, value in weights(resumed.model).items())
    verify_checkpoint(root / "step_3")  # saved again over the corrupted one


def test_a_step_directory_without_metadata_is_moved_aside(tmp_path):
    overrides = ["training.checkpoint_interval=1", "training.checkpoint_keep=4"]
    train(configure(tmp_path, "training.train_iters=2", *overrides))
    (tmp_path / "step_2" / "metadata.yaml").unlink()
    messages = []
    train(configure(tmp_path, "training.train_iters=3", *overrides), log=messages.append)
    assert f"resumed from {tmp_path / 'step_1'} (step 1)" in messages
    aside = tmp_path / "step_2.not-a-checkpoint"
    assert (
        f"{tmp_path / 'step_2'} exists and is not a checkpoint (no metadata.yaml): moved it aside to {aside}"
        in messages
    )
    assert run_dirs(tmp_path) == ["step_1", "step_2", "step_2.not-a-checkpoint", "step_3"]
    assert (aside / "model.safetensors").is_file()


# ---------------------------------------------------------------------------------------------------------------------
# 10. Checksums and dtypes


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("saved")
    train(configure(root, "training.train_iters=1"))
    return root / "step_1"


@pytest.fixture
def copy(saved, tmp_path) -> Path:
    shutil.copytree(saved, tmp_path / "step_1")
    return tmp_path / "step_1"


def drop_checksums(directory: Path) -> None:
    """Make `directory` a checkpoint as written before checksums were recorded."""
    path = directory / "metadata.yaml"
    metadata = yaml.safe_load(path.read_text())
    del metadata["checksums"]
    path.write_text(yaml.safe_dump(metadata))


def test_every_file_has_a_checksum_that_loading_verifies(copy):
    checksums = yaml.safe_load((copy / "metadata.yaml").read_text())["checksums"]
    assert checksums["algorithm"] == "xxh3-128"
    assert sorted(checksums["files"]) == ["config.yaml", "model.safetensors", "optimizer.safetensors"]
    for name in ("model.safetensors", "optimizer.safetensors"):
        original = (copy / name).read_bytes()
        flip_a_tensor_byte(copy / name)
        with pytest.raises(CheckpointError) as caught:
            verify_checkpoint(copy)
        assert caught.value.path == copy / name and caught.value.problem.startswith("corrupted or rewritten since")
        (copy / name).write_bytes(original)
    verify_checkpoint(copy)


def test_a_saved_checkpoint_records_the_xxh3_of_its_files(copy):
    # The reference: xxhash's one-shot XXH3-128 of each file's bytes, read back whole.
    import xxhash

    checksums = yaml.safe_load((copy / "metadata.yaml").read_text())["checksums"]["files"]
    for file, digest in checksums.items():
        assert digest == xxhash.xxh3_128_hexdigest((copy / file).read_bytes()), file


def test_the_xxh3_of_a_mapped_file_is_that_of_its_bytes(tmp_path):
    # Hashed a 1 MiB piece at a time from the map (each unmapped once hashed), a tail, an empty file.
    import xxhash

    data = os.urandom(3 * 2**20 + 12345)
    (tmp_path / "file").write_bytes(data)
    assert blockzoo.checkpoint.file_checksum(tmp_path / "file") == xxhash.xxh3_128_hexdigest(data)
    (tmp_path / "empty").write_bytes(b"")
    assert blockzoo.checkpoint.file_checksum(tmp_path / "empty") == xxhash.xxh3_128_hexdigest(b"")


def sha256_chunks(data: bytes, chunk: int) -> str:
    """The SHA-256 of the SHA-256 digests of `data`'s chunks (an empty file: one empty chunk), by hashlib: what
    earlier checkpoints record."""
    import hashlib

    starts = range(0, max(len(data), 1), chunk)
    digests = b"".join(hashlib.sha256(data[start : start + chunk]).digest() for start in starts)
    return hashlib.sha256(digests).hexdigest()


def test_the_chunked_sha256_is_the_sha256_of_the_chunk_digests(tmp_path, monkeypatch):
    monkeypatch.setattr(blockzoo.checkpoint.checksums, "_CHUNK", 1000)
    data = os.urandom(4321)
    (tmp_path / "file").write_bytes(data)
    assert blockzoo.checkpoint.file_checksum(tmp_path / "file", algorithm="sha256-16MiB-chunks") == sha256_chunks(
        data, 1000
    )


def test_the_chunked_sha256_of_a_mapped_file_is_that_of_its_bytes(tmp_path):
    # Chunks of 16 MiB (page-aligned: hashed from the map, then unmapped) and a tail; the reference: hashlib.
    data = os.urandom(2 * 2**24 + 12345)
    (tmp_path / "file").write_bytes(data)
    legacy = "sha256-16MiB-chunks"
    assert blockzoo.checkpoint.file_checksum(tmp_path / "file", algorithm=legacy) == sha256_chunks(data, 2**24)
    (tmp_path / "empty").write_bytes(b"")
    assert blockzoo.checkpoint.file_checksum(tmp_path / "empty", algorithm=legacy) == sha256_chunks(b"", 2**24)


def test_a_checkpoint_with_sha256_checksums_still_loads_and_is_verified(copy):
    # As blockzoo wrote checkpoints before XXH3: every file's chunked SHA-256, recorded with that algorithm's name.
    path = copy / "metadata.yaml"
    metadata = yaml.safe_load(path.read_text())
    files = {file: sha256_chunks((copy / file).read_bytes(), 2**24) for file in metadata["checksums"]["files"]}
    metadata["checksums"] = {"algorithm": "sha256-16MiB-chunks", "files": files}
    path.write_text(yaml.safe_dump(metadata))
    verify_checkpoint(copy)
    model = blockzoo.load(copy)
    saved = load_file(copy / "model.safetensors")
    assert all(torch.equal(saved[name], parameter) for name, parameter in model.named_parameters())
    flip_a_tensor_byte(copy / "model.safetensors")
    with pytest.raises(CheckpointError) as caught:
        verify_checkpoint(copy)
    assert caught.value.problem.startswith("corrupted or rewritten since")


def test_an_unknown_checksum_algorithm_is_refused_by_name(copy):
    path = copy / "metadata.yaml"
    metadata = yaml.safe_load(path.read_text())
    metadata["checksums"]["algorithm"] = "md5"
    path.write_text(yaml.safe_dump(metadata))
    with pytest.raises(CheckpointError) as caught:
        blockzoo.load(copy)
    assert caught.value.path == path
    assert caught.value.problem == (
        "unknown checksum algorithm 'md5' (this blockzoo knows xxh3-128, sha256-16MiB-chunks)"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_the_finiteness_check_agrees_with_isfinite(dtype):
    # The check sums first (a finite sum proves every value finite); compared with torch.isfinite value by value,
    # on tensors whose sum overflows though every value is finite, and on each kind of non-finite value.
    largest = torch.finfo(dtype).max
    cases = {
        "random": torch.randn(1000),
        "empty": torch.empty(0),
        "finite, the sum overflows": torch.full((64,), largest / 4, dtype=dtype),
        "finite, +max and -max": torch.tensor([largest, -largest, largest], dtype=dtype),
    }
    for position in (0, 517, 999):
        for value in (float("nan"), float("inf"), float("-inf")):
            tensor = torch.randn(1000)
            tensor[position] = value
            cases[f"{value} at {position}"] = tensor
    both = torch.randn(1000)
    both[3], both[800] = float("inf"), float("-inf")
    cases["inf and -inf"] = both
    for what, tensor in cases.items():
        tensor = tensor.to(dtype)
        assert blockzoo.checkpoint.gather._all_finite(tensor) == bool(torch.isfinite(tensor).all()), what


def test_a_checkpoint_without_checksums_still_loads_and_refuses_another_dtype(copy):
    drop_checksums(copy)
    model = blockzoo.load(copy)
    saved = load_file(copy / "model.safetensors")
    assert all(torch.equal(saved[name], parameter) for name, parameter in model.named_parameters())
    save_file({name: tensor.to(torch.bfloat16) for name, tensor in saved.items()}, copy / "model.safetensors")
    with pytest.raises(CheckpointError) as caught:
        blockzoo.load(copy)
    assert caught.value.path == copy / "model.safetensors"
    assert caught.value.problem.endswith("is torch.bfloat16, but torch.float32 was saved (and is expected)")


# ---------------------------------------------------------------------------------------------------------------------
# 11. Edits of config.yaml, bad metadata: one rule, and the file at fault named


def edit_config(directory: Path, hidden_size: int) -> None:
    path = directory / "config.yaml"
    config = yaml.safe_load(path.read_text())
    config["model"]["hidden_size"] = hidden_size
    path.write_text(yaml.safe_dump(config))


def test_an_edited_config_is_refused_by_load_generate_and_resume(copy, capsys):
    edit_config(copy, 32)
    message = "config.yaml: edited since the checkpoint was saved"
    with pytest.raises(CheckpointError, match=message):
        blockzoo.load(copy)
    assert cli.main(["generate", str(copy), "--prompt", "a", "--max-new-tokens", "2"]) == 2
    assert message in capsys.readouterr().err
    # Resuming from the run directory: the edited checkpoint is skipped (it was the only one: a fresh start).
    messages = []
    train(configure(copy.parent, "training.train_iters=2"), log=messages.append)
    assert any(message in line and line.startswith("skipped checkpoint") for line in messages)
    assert not any(line.startswith("resumed from") for line in messages)


def test_a_hidden_size_mismatch_names_both_files_and_a_bad_data_position_names_the_metadata(copy):
    drop_checksums(copy)
    edit_config(copy, 32)
    with pytest.raises(CheckpointError) as caught:
        blockzoo.load(copy)
    assert caught.value.path == copy / "model.safetensors"
    assert f"but the model of {copy / 'config.yaml'} expects [257, 32]: the two disagree" in caught.value.problem
    edit_config(copy, 16)
    with pytest.raises(CheckpointError, match=r"model.safetensors: .*but the model of the run config expects"):
        Trainer(configure(copy.parent, "model.hidden_size=32"), log=quiet)
    path = copy / "metadata.yaml"
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), "data": {"next_sample": -1}}))
    with pytest.raises(CheckpointError) as caught:
        Trainer(configure(copy.parent), log=quiet)
    assert caught.value.path == path and "bad data position {'next_sample': -1}" in caught.value.problem


# ---------------------------------------------------------------------------------------------------------------------
# 13. Non-finite weights are never saved, non-finite logits never generate


def test_weights_made_non_finite_by_the_update_are_never_saved(tmp_path):
    config = configure(tmp_path, "training.train_iters=3", "training.checkpoint_interval=1")
    trainer = Trainer(config, log=quiet)
    step = trainer.optimizer.step

    def diverging_step(*args, **kwargs):  # the loss and gradients of step 2 are finite; the update is not
        step(*args, **kwargs)
        if trainer.step == 1:
            with torch.no_grad():
                trainer.model.head.output_weight[0, 0] = float("nan")

    trainer.optimizer.step = diverging_step
    with pytest.raises(TrainingError) as caught:
        trainer.run()
    assert str(caught.value) == (
        f"after step 2, {tmp_path / 'step_2' / 'model.safetensors'}: tensor 'head.output_weight' has non-finite values "
        f"(nan or inf); refusing to save it; stopping, the last checkpoint ({tmp_path / 'step_1'}) is intact"
    )
    assert run_dirs(tmp_path) == ["step_1"]
    assert all(torch.isfinite(parameter).all() for parameter in blockzoo.load(tmp_path).parameters())


def test_generate_refuses_a_model_whose_logits_are_not_finite(tmp_path, capsys):
    model = blockzoo.build({**BASE, "distributed": {"backend": "gloo"}})
    with torch.no_grad():
        model.head.output_weight.fill_(3e38)  # finite weights (they save), logits that overflow float32
    blockzoo.save(model, tmp_path / "diverged")
    with pytest.raises(UsageError, match=r"the model's logits are not finite \(nan or inf\) for new token 1"):
        model.generate([[1, 2]], 3)
    assert cli.main(["generate", str(tmp_path / "diverged"), "--prompt", "ab"]) == 2
    assert "blockzoo: error: the model's logits are not finite" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------------
# The kill test: SIGKILL at random moments during saves and pruning


KILL_RUN = [
    "training.train_iters=100000",
    "training.checkpoint_interval=1",
    "training.checkpoint_keep=2",
    "training.log_interval=1000",
    "model.hidden_size=256",  # a few MB a checkpoint: the saves and prunings take most of the time
]


def kill_repeatedly(tmp_path: Path, kills: int, seed: int) -> None:
    """Start the run (resuming where the last one was killed), let it save a few times, SIGKILL it at a random
    moment; each time the newest valid checkpoint loads and the next start resumes from it."""
    chance = random.Random(seed)
    path = write_config(tmp_path)
    root = tmp_path / "run"
    previous = None
    for kill in range(kills):
        process = subprocess.Popen(
            [sys.executable, "-m", "blockzoo", "train", str(path), *KILL_RUN],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for line in process.stdout:
            if line.startswith("resumed from") and previous is not None:
                assert line.split()[2] == str(previous), (kill, line)
            if line.startswith("saved checkpoint"):
                break
        time.sleep(chance.uniform(0.0, 0.5))  # then a kill in the middle of whatever it is doing
        process.kill()
        process.wait()
        previous = latest_checkpoint(root)
        assert previous is not None, kill
        blockzoo.load(previous)
        assert not [path for path in root.glob("step_*") if not (path / "metadata.yaml").is_file()]


def test_kill_during_saves_and_pruning(tmp_path):
    kill_repeatedly(tmp_path, kills=4, seed=0)


@pytest.mark.slow
def test_kill_during_saves_and_pruning_many_times(tmp_path):
    kill_repeatedly(tmp_path, kills=60, seed=1)


# ---------------------------------------------------------------------------------------------------------------------
# Every rank agrees to stop


def _stop_on_one_rank(root: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        config = configure(Path(root), "training.train_iters=4", "training.checkpoint_interval=100")
        with Trainer(config, log=quiet) as trainer:
            if dist.get_rank() == 1:  # only rank 1 hears the signal, during step 2
                train_step = trainer._train_step

                def signalled_step(*args, **kwargs):
                    if trainer.step == 1:
                        signal.raise_signal(signal.SIGTERM)
                    return train_step(*args, **kwargs)

                trainer._train_step = signalled_step
            history = trainer.run()
        (Path(root) / f"rank_{dist.get_rank()}.json").write_text(json.dumps([record.step for record in history]))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_every_rank_stops_at_the_step_boundary_where_one_rank_heard_the_signal(tmp_path):
    from blockzoo_testing.distributed import run_distributed

    run_distributed(2, _stop_on_one_rank, str(tmp_path))
    assert [json.loads((tmp_path / f"rank_{rank}.json").read_text()) for rank in (0, 1)] == [[1, 2], [1, 2]]
    assert run_dirs(tmp_path) == ["rank_0.json", "rank_1.json", "step_2"]
    metadata = yaml.safe_load((tmp_path / "step_2" / "metadata.yaml").read_text())
    assert len(metadata["extra"]["random_states"]) == 2  # each rank's
