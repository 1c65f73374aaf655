"""What a newcomer tripped on, through the real CLI: `blockzoo --version`, the core-only example config, every mesh
dimension in `blockzoo config --processes`, and `blockzoo generate` on checkpoints that cannot give a tokenizer
(a Llama export converted back; a run whose plugin is gone) ending in one right message, exit 2."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import blockzoo

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
USAGE_ERROR = 2
TINY = {
    "model": {
        "hidden_size": 16,
        "embeddings": {"vocab_size": 257},
        "decoder": {
            "num_blocks": 1,
            "block": {
                "mixer": {"type": "attention", "heads": 2, "head_size": 8},
                "mlp": {"type": "moe", "experts": 2, "experts_per_token": 1, "intermediate_size": 16},
            },
        },
    },
    "data": {"type": "embedded", "num_documents": 20, "sequence_length": 16, "micro_batch_size": 1},
}


def blockzoo_command(*arguments, **environment) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "blockzoo", *map(str, arguments)],
        capture_output=True,
        text=True,
        encoding="utf-8",
        env={**os.environ, "PYTHONIOENCODING": "utf-8", **environment},
        timeout=180,
    )


def assert_usage_error(result: subprocess.CompletedProcess, *expected: str) -> None:
    assert result.returncode == USAGE_ERROR, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    for text in expected:
        assert text in result.stderr, f"{text!r} not in: {result.stderr}"


def test_version_names_the_core_and_every_plugin():
    result = blockzoo_command("--version")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"blockzoo {blockzoo.__version__}"
    from importlib.metadata import version

    assert f"blockzoo-attention {version('blockzoo-attention')} (plugin 'attention')" in lines


def test_the_core_only_example_config_is_accepted():
    result = blockzoo_command("config", ROOT / "examples" / "run.yaml")
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["data"]["type"] == "random"


def test_config_processes_names_every_mesh_dimension(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(TINY | {"model": {**TINY["model"], "decoder": {"num_blocks": 2}}}))
    result = blockzoo_command(
        "config", config, "distributed.sequence_data_parallel=2", "model.decoder.block.mixer.type=mamba_2",
        "model.decoder.block.mlp.type=none", "--processes", 4,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    expected = "1 tensor-parallel × 2 sequence-data-parallel × 2 data-parallel × 1 pipeline stage"
    assert f"the layout of 4 process(es): {expected}" in result.stderr


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("native") / "checkpoint"
    blockzoo.save(blockzoo.build(TINY), path)
    return path


def test_generate_on_an_export_converted_back_encodes_as_the_original(checkpoint, tmp_path):
    assert blockzoo_command("convert", checkpoint, tmp_path / "exported", "--format", "mixtral").returncode == 0
    assert blockzoo_command("convert", tmp_path / "exported", tmp_path / "back").returncode == 0
    outputs = [
        blockzoo_command("generate", path, "--prompt", "Once", "--max-new-tokens", 4)
        for path in (checkpoint, tmp_path / "back")
    ]
    assert outputs[0].returncode == outputs[1].returncode == 0, outputs[1].stderr
    assert outputs[0].stdout == outputs[1].stdout


def test_generate_of_a_model_with_no_tokenizer_says_so(tmp_path):
    blockzoo.save(blockzoo.build({"model": TINY["model"]}), tmp_path / "bare")  # data: a memmap of no path
    result = blockzoo_command("generate", tmp_path / "bare", "--prompt", "Once", "--max-new-tokens", 2)
    assert_usage_error(result, "carries no tokenizer.json, and its training data (memmap type) cannot give one")


def test_generate_of_a_run_whose_plugin_is_gone_says_that_alone(checkpoint, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(checkpoint, run / "step_1")
    result = blockzoo_command("generate", run, "--prompt", "Once", BLOCKZOO_DISABLE_PLUGINS="moe")
    assert_usage_error(result, "moe", "is a run directory, but none of its 1 checkpoints can be read")
    assert "nor a run directory" not in result.stderr
    assert blockzoo_command("generate", run, "--prompt", "Once", "--max-new-tokens", 1).returncode == 0


@pytest.mark.parametrize("format", ["blockzoo", "mixtral"])
def test_save_refuses_a_directory_in_use_as_convert_does(checkpoint, tmp_path, format):
    model = blockzoo.load(checkpoint)
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    with pytest.raises(blockzoo.checkpoint.CheckpointError, match="exists and is not empty; choose a new directory"):
        blockzoo.save(model, used, format=format)
    assert (used / "notes.txt").read_text() == "mine"
    result = blockzoo_command("convert", checkpoint, used, "--format", "mixtral")
    assert_usage_error(result, "exists and is not empty; choose a new directory")
    with pytest.raises(blockzoo.checkpoint.CheckpointError, match="holds something other than a checkpoint"):
        blockzoo.save(model, used, format=format, overwrite=True)
    assert (used / "notes.txt").read_text() == "mine"
    saved = blockzoo.save(model, tmp_path / "new", format=format)
    blockzoo.save(model, saved, format=format, overwrite=True)  # a checkpoint is replaced
    tokens = torch.arange(8).unsqueeze(0)
    torch.testing.assert_close(blockzoo.load(saved)(tokens), model(tokens))


HYBRID = {
    "hidden_size": 16,
    "embeddings": {"vocab_size": 257},
    "decoder": {
        "type": "pattern",
        "num_blocks": 2,
        "pattern": ["ssm", "attn"],
        "blocks": {
            "ssm": {
                "mixer": {"type": "mamba_2", "state_size": 4, "head_size": 8, "chunk_size": 8},
                "mlp": {"type": "none"},
            },
            "attn": {"mixer": {"type": "attention", "heads": 2, "head_size": 8}, "mlp": {"type": "none"}},
        },
    },
}


def test_a_partial_override_of_a_pretrained_pattern_keeps_the_checkpoint_types(tmp_path):
    blockzoo.save(blockzoo.build({"model": HYBRID}), tmp_path / "base")
    partial = {"pretrained": str(tmp_path / "base"), "decoder": {"blocks": {"attn": {"mixer": {"window_size": 4}}}}}
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": partial, "data": TINY["data"]}))
    result = blockzoo_command("config", config)
    assert result.returncode == 0, result.stderr
    decoder = yaml.safe_load(result.stdout)["model"]["decoder"]
    assert decoder["type"] == "pattern" and decoder["pattern"] == ["ssm", "attn"]
    assert decoder["blocks"]["attn"]["mixer"]["window_size"] == 4
    assert decoder["blocks"]["ssm"]["mixer"]["type"] == "mamba_2"
    model = blockzoo.build(config)
    assert model.config.decoder.blocks["attn"].mixer.window_size == 4
    assert model.config.decoder.blocks["ssm"].mixer.state_size == 4


def test_a_section_read_as_the_default_type_says_so(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"decoder": {"blocks": {"a": {}}, "pattern": ["a"]}}}))
    assert_usage_error(
        blockzoo_command("config", config),
        "model.decoder.blocks: unknown key; did you mean 'block'?",
        "(no `type` given: the default block_sequence type 'fixed' was assumed)",
    )


def test_the_readme_prepare_recipe_trains_the_demo_as_written(tmp_path):
    recipe = re.search(r"then (data: \{type: memmap,.*?\})", " ".join(README.read_text().split()).replace("# ", ""))
    data = yaml.safe_load(recipe.group(1).replace("data/tokens", str(tmp_path / "tokens")))["data"]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(f'{{"text": "Story {i}: {"once upon a time " * 40}"}}\n' for i in range(400)))
    assert blockzoo_command("prepare", corpus, "--output", tmp_path / "tokens").returncode == 0
    overrides = [f"data={data}", "training.train_iters=1", f"training.output_dir={tmp_path / 'run'}"]
    result = blockzoo_command("train", ROOT / "examples" / "demo.yaml", *overrides)
    assert result.returncode == 0, result.stderr
    assert "evaluation at step 1: loss" in result.stdout


def test_the_config_reference_lists_what_the_readme_installs():
    install = README.read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    folders = re.findall(r"-e ([\w/]+)", install)
    readme_distributions = {
        re.search(r'^name = "([^"]+)"', (ROOT / folder / "pyproject.toml").read_text(), re.MULTILINE).group(1)
        for folder in folders
    }
    header = (ROOT / "docs" / "config-reference.md").read_text().split("\n")[2]
    listed = set(re.findall(r"\(([a-z0-9-]+) \d", header))
    assert listed and listed <= readme_distributions, listed - readme_distributions
