"""blockzoo's own checkpoints are a registered checkpoint format like any other: the core's plugin registers it,
`blockzoo plugins` lists it, `blockzoo.load` finds it among the registered formats, and a run may export to it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import blockzoo
from blockzoo.cli import main
from blockzoo.config import structure
from blockzoo.conversion import ConversionError, checkpoint_formats, get_format
from blockzoo.model.native import checkpoint_format
from blockzoo.plugins import get_registry
from blockzoo.run_config import RunConfig

MODEL = {
    "hidden_size": 16,
    "embeddings": {"vocab_size": 32},
    "decoder": {"num_blocks": 1, "block": {"mixer": {"type": "none"}, "mlp": {"type": "none"}}},
}


def test_the_native_format_is_registered_by_the_core_plugin(capsys):
    native = checkpoint_formats()["blockzoo"]
    [entry] = [entry for entry in get_registry().converters if entry.section is native]
    assert entry.plugin.name == "blockzoo" and get_format("blockzoo") is native
    assert main(["plugins", "--json"]) == 0
    plugins = {plugin["name"]: plugin for plugin in json.loads(capsys.readouterr().out)["plugins"]}
    assert plugins["blockzoo"]["formats"] == ["blockzoo"]


def test_a_run_exporting_to_the_native_format_is_refused_before_training(tmp_path):
    from blockzoo.training.trainer import Trainer

    config = {"model": MODEL, "distributed": {"backend": "gloo"}, "data": {"type": "random", "sequence_length": 8}}
    config["training"] = {"train_iters": 1, "output_dir": str(tmp_path / "run"), "export_format": "blockzoo"}
    with pytest.raises(ConversionError, match="a run's checkpoints are blockzoo checkpoints already"):
        Trainer(structure(config, RunConfig), log=lambda _: None)
    assert not (tmp_path / "run" / "step_1").exists()


def test_registering_it_imports_no_torch():
    probe = "import sys; from blockzoo.plugins import get_registry; get_registry(); print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip() == "False"


def test_a_saved_checkpoint_loads_through_the_registered_format(tmp_path):
    model = blockzoo.build({"model": MODEL})
    blockzoo.save(model, tmp_path / "saved")
    assert checkpoint_format(tmp_path / "saved") is checkpoint_formats()["blockzoo"]
    loaded = blockzoo.load(tmp_path / "saved")
    for (name, parameter), (loaded_name, loaded_parameter) in zip(
        model.named_parameters(), loaded.named_parameters(), strict=True
    ):
        assert name == loaded_name and torch.equal(parameter, loaded_parameter), name
    # The registered format writes what `blockzoo.save` writes.
    checkpoint_formats()["blockzoo"].save(model, tmp_path / "through_format")
    again = blockzoo.load(tmp_path / "through_format")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
