"""`blockzoo convert` in both directions, and `blockzoo train` starting from a Hugging Face checkpoint and exporting
to one at the end."""

from __future__ import annotations

import json

import pytest
import torch
from hf_cases import hf_logits, hf_model, load_hf, our_logits

import blockzoo
import blockzoo.layers.parameter
from blockzoo.cli import main
from blockzoo.config import ConfigError, structure
from blockzoo.conversion import ConversionError
from blockzoo.run_config import RunConfig
from blockzoo.training.trainer import Trainer


@pytest.fixture(scope="module")
def hf_directory(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mixtral")
    model = hf_model("mixtral")
    model.save_pretrained(directory)
    return directory, hf_logits(model)


def test_convert_to_blockzoo_and_back(hf_directory, tmp_path, capsys):
    directory, expected = hf_directory
    assert main(["convert", str(directory), str(tmp_path / "native")]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'native'} (blockzoo)"
    torch.testing.assert_close(our_logits(blockzoo.load(tmp_path / "native")), expected, atol=1e-4, rtol=1e-4)

    assert main(["convert", str(tmp_path / "native"), str(tmp_path / "hf"), "--format", "mixtral"]) == 0
    torch.testing.assert_close(hf_logits(load_hf(tmp_path / "hf")), expected, atol=1e-4, rtol=1e-4)
    assert main(["convert", str(directory), str(tmp_path / "bf16"), "--format", "mixtral", "--dtype", "bfloat16"]) == 0
    assert load_hf(tmp_path / "bf16").dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--format", "llama"], "decoder.0.mixer: `window_size` = 7 cannot be written: the format has only None"),
        (["--format", "gpt2"], "unknown checkpoint format 'gpt2'; available: blockzoo, "),
        (["--format", "mixtral", "--dtype", "int8"], "unknown dtype 'int8'"),
    ],
)
def test_convert_errors_exit_2_with_the_reason(hf_directory, tmp_path, capsys, arguments, message):
    assert main(["convert", str(hf_directory[0]), str(tmp_path / "out"), *arguments]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_convert_refuses_a_destination_that_is_not_empty(hf_directory, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    assert main(["convert", str(hf_directory[0]), str(tmp_path / "out")]) == 2
    assert "out: exists and is not empty" in capsys.readouterr().err
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


def _run_config(hf_dir, output_dir, **training) -> RunConfig:
    return structure(
        {
            "model": {
                "pretrained": str(hf_dir),
                "decoder": {"block": {"mlp": {"type": "moe", "z_loss_coefficient": 0.001}}},
            },
            "data": {"type": "random", "vocab_size": 128, "sequence_length": 16, "micro_batch_size": 2},
            "training": {
                "train_iters": 3,
                "log_interval": 1,
                "output_dir": str(output_dir),
                "optimizer": {"learning_rate": 1e-3},
                **training,
            },
        },
        RunConfig,
    )


def test_train_from_a_huggingface_checkpoint_and_export(hf_directory, tmp_path):
    directory, expected = hf_directory
    trainer = Trainer(_run_config(directory, tmp_path / "run", export_format="mixtral"), log=lambda _: None)
    # The pretrained architecture, the field given beside it, and the pretrained weights.
    assert trainer.run_config.model.pretrained is None
    assert trainer.run_config.model.decoder.block.mlp.experts == 4
    assert trainer.run_config.model.decoder.block.mlp.z_loss_coefficient == 0.001
    torch.testing.assert_close(our_logits(trainer.model), expected, atol=1e-4, rtol=1e-4)

    history = trainer.run()
    assert len(history) == 3 and any("router_z_loss" in name for name in history[-1].losses)
    exported = load_hf(tmp_path / "run" / "mixtral")
    trained = our_logits(trainer.model)
    assert not torch.allclose(trained, expected, atol=1e-3)
    torch.testing.assert_close(hf_logits(exported), trained, atol=1e-4, rtol=1e-4)
    # The checkpoint's config is complete: it loads without the Hugging Face directory.
    assert blockzoo.load(tmp_path / "run").config == trainer.model.config


def test_models_from_a_huggingface_checkpoint_are_not_initialized_first(hf_directory, tmp_path, monkeypatch):
    def never(parameter, distributed):
        raise AssertionError(f"{parameter.meta.name} initialized, then overwritten by the checkpoint")

    monkeypatch.setattr(blockzoo.layers.parameter, "initialize_parameter", never)
    torch.testing.assert_close(our_logits(blockzoo.load(hf_directory[0])), hf_directory[1], atol=1e-4, rtol=1e-4)
    trainer = Trainer(_run_config(hf_directory[0], tmp_path / "run"), log=lambda _: None)
    torch.testing.assert_close(our_logits(trainer.model), hf_directory[1], atol=1e-4, rtol=1e-4)


def test_a_resumed_run_takes_its_model_from_its_checkpoint(hf_directory, tmp_path):
    first = Trainer(_run_config(hf_directory[0], tmp_path / "run"), log=lambda _: None)
    first.run()
    resumed = Trainer(_run_config(hf_directory[0], tmp_path / "run", train_iters=4), log=lambda _: None)
    assert resumed.run_config.model == first.run_config.model
    assert [record.step for record in resumed.run()] == [4]


def test_an_export_format_is_checked_when_the_config_is_read(hf_directory, tmp_path):
    with pytest.raises(ConfigError, match=r"training.export_format: unknown checkpoint format 'lama'"):
        _run_config(hf_directory[0], tmp_path, export_format="lama")
    with pytest.raises(ConfigError, match=r"training.export_dir: needs an export_format"):
        _run_config(hf_directory[0], tmp_path, export_dir=str(tmp_path / "x"))


def test_a_model_the_export_format_cannot_hold_is_refused_before_training(hf_directory, tmp_path):
    with pytest.raises(ConversionError, match="`window_size` = 7 cannot be written: the format has only None"):
        Trainer(_run_config(hf_directory[0], tmp_path / "run", export_format="llama"), log=lambda _: None)


def test_blockzoo_plugins_lists_the_formats_and_who_contributes_sections(capsys):
    assert main(["plugins"]) == 0
    text = capsys.readouterr().out
    huggingface = text[text.index("\nhuggingface  [loaded]") :].split("\n\n")[0]
    formats = "llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe, mamba, jamba"
    assert f"  formats: {formats}" in huggingface
    moe = text[text.index("\nmoe  [loaded]") :].split("\n\n")[0]
    moe_formats = "deepseek_v3, granitemoehybrid, jamba, mixtral, nemotron_h, qwen2_moe, qwen3_moe, qwen3_next"
    assert f"  sections for: {moe_formats}" in moe
    assert main(["plugins", "--json"]) == 0
    plugins = {plugin["name"]: plugin for plugin in json.loads(capsys.readouterr().out)["plugins"]}
    assert "nemotron_h" in plugins["huggingface"]["formats"] and "formats" not in plugins["moe"]
