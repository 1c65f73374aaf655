"""An export is durable by default (every shard fsynced before the directory is renamed into place); `durable=False`
(`blockzoo convert --no-fsync`) leaves the same bytes in the page cache, as transformers' `save_pretrained` does.
Which files were synced is seen through `os.fsync` itself; the files are compared byte for byte and loaded by
transformers."""

from __future__ import annotations

import os

import pytest
import torch
from hf_cases import hf_logits, load_hf, our_logits, save_hf_model

import blockzoo
from blockzoo import safetensors_io
from blockzoo.cli import main

SHARD = 64 * 1024  # several shards from the tiny model


@pytest.fixture
def synced(monkeypatch) -> list[str]:
    """The names of the files fsynced from now on; early writeback (`sync_file_range`) counts as a sync too."""
    names: list[str] = []
    real_fsync = os.fsync

    def fsync(descriptor: int) -> None:
        names.append(os.path.basename(os.readlink(f"/proc/self/fd/{descriptor}")))
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(
        safetensors_io, "_start_writeback", lambda descriptor, *_: names.append(f"writeback {descriptor}")
    )
    return names


def _shards(directory) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.glob("*.safetensors"))}


def test_an_export_syncs_every_shard_unless_asked_not_to(tmp_path, synced):
    reference = save_hf_model("llama_llama3", tmp_path / "hf")
    model = blockzoo.load(tmp_path / "hf")
    synced.clear()
    blockzoo.save(model, tmp_path / "durable", format="llama", max_shard_size=SHARD)
    shards = _shards(tmp_path / "durable")
    assert len(shards) > 2
    assert set(shards) <= set(synced) and any(name.startswith("writeback") for name in synced)

    synced.clear()
    blockzoo.save(model, tmp_path / "unsynced", format="llama", max_shard_size=SHARD, durable=False)
    assert synced == []
    assert _shards(tmp_path / "unsynced") == shards
    torch.testing.assert_close(hf_logits(load_hf(tmp_path / "unsynced")), hf_logits(reference), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(our_logits(model), hf_logits(reference), atol=1e-4, rtol=1e-4)


def test_convert_no_fsync_writes_the_same_export_unsynced(tmp_path, capsys, synced):
    save_hf_model("llama_llama3", tmp_path / "hf")
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "native")]) == 0
    assert main(["convert", str(tmp_path / "native"), str(tmp_path / "durable"), "--format", "llama"]) == 0
    synced.clear()
    assert main(["convert", str(tmp_path / "native"), str(tmp_path / "fast"), "--format", "llama", "--no-fsync"]) == 0
    assert synced == []
    assert _shards(tmp_path / "fast") == _shards(tmp_path / "durable")
    capsys.readouterr()

    # A native checkpoint is always synced: the flag is refused, not ignored.
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "refused"), "--no-fsync"]) == 2
    assert "--no-fsync applies to exports to another format" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()
