"""The first-party presets, every plugin installed: `blockzoo models` lists each (and docs/models.md is generated from
it), overrides merge into a published preset's own types, `blockzoo init` of a large one lays it over several
processes and `blockzoo config` reports that layout's memory, `blockzoo.build` takes a preset's name. The counts
against transformers: converters/huggingface/tests/test_presets_against_transformers.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import blockzoo
from blockzoo import preset_catalogue, presets
from blockzoo.api import Preset
from blockzoo.cli import main
from blockzoo.config import load, structure, to_dict
from blockzoo.model.config import ModelConfig
from blockzoo.run_config import RunConfig

DOCS = Path(__file__).parents[1] / "docs" / "models.md"
# The named architectures the catalogue must have, by family.
REQUIRED = {
    "llama3_2_1b", "llama3_2_3b", "llama3_1_8b",
    "qwen3_0_6b", "qwen3_1_7b", "qwen3_4b", "qwen3_8b", "qwen3_30b_a3b",
    "mistral_7b", "mixtral_8x7b",
    "mamba2_130m", "mamba2_370m", "mamba2_780m", "mamba2_1_3b", "mamba2_2_7b",
    "falcon_h1_0_5b", "falcon_h1_1_5b", "falcon_h1_1_5b_deep", "falcon_h1_3b", "falcon_h1_7b",
    "nemotron_h_8b", "granite_4_0_h_tiny", "qwen3_next_80b_a3b", "deepseek_v3",
}  # fmt: skip


def test_the_catalogue_holds_every_required_model_and_proxies_of_each_family():
    names = set(presets.names())
    assert names >= REQUIRED
    families = {presets.get(name).family for name in REQUIRED}
    proxied = {presets.get(name).family for name in names if presets.get(name).ours}
    assert families <= proxied, families - proxied
    for name in names:
        preset = presets.get(name)
        assert preset.source.startswith("https://huggingface.co/") != preset.ours, name


def test_every_published_preset_names_the_stored_copies_it_was_checked_against():
    for name in presets.names():
        preset = presets.get(name)
        if not preset.ours:
            assert preset.checked_against, f"{name}: no stored copy of its published values named"
            assert all(len(source) > 40 for source in preset.checked_against), name  # where, and which fields


def test_a_preset_s_checked_against_is_a_tuple_of_sources():
    with pytest.raises(ValueError, match="checked_against"):
        Preset(family="x", parameters=1, source="ours", requires=("blockzoo",), config={}, checked_against="a page")


def test_docs_models_md_is_generated_from_the_catalogue():
    expected = preset_catalogue.markdown(preset_catalogue.rows())
    assert DOCS.read_text() == expected, "regenerate: blockzoo models --markdown > docs/models.md"


def test_blockzoo_models_lists_every_preset(capsys):
    assert main(["models"]) == 0
    lines = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert sorted(lines) == presets.names()
    assert lines["mixtral_8x7b"][2:4] == ["46.7B", "12.9B"] and lines["mixtral_8x7b"][-2:] == ["mixtral", "yes"]
    assert lines["qwen3_proxy_125m"][4] == "ours"


def test_overrides_merge_into_a_published_preset_s_own_types():
    preset = presets.model_config("qwen3_0_6b")
    changes = {"decoder": {"num_blocks": 2, "block": {"mixer": {"rotary": {"theta": 5.0e6}}}}}
    changed = presets.model_config("qwen3_0_6b", changes)
    assert changed.decoder.num_blocks == 2 and preset.decoder.num_blocks == 28
    mixer, original = changed.decoder.block.mixer, preset.decoder.block.mixer
    assert mixer.rotary.theta == 5.0e6 and type(mixer.rotary) is type(original.rotary)
    # Everything not overridden is the preset's: the query/key norms, head sizes, the MLP.
    assert to_dict(mixer) | {"rotary": None} == to_dict(original) | {"rotary": None}
    assert changed.decoder.block.mlp == preset.decoder.block.mlp and changed.embeddings == preset.embeddings


def test_init_lays_a_large_preset_over_several_processes_and_config_reports_its_memory(capsys, tmp_path):
    output = tmp_path / "run.yaml"
    assert main(["init", "llama3_1_8b", "--output", str(output)]) == 0
    run_config = load(RunConfig, output)
    assert run_config.model == presets.model_config("llama3_1_8b") and run_config.distributed.zero_stage == 3
    assert "--nproc-per-node 4" in output.read_text()
    capsys.readouterr()
    assert main(["config", str(output), "--processes", "4"]) == 0
    # 8,030,261,248 parameters, 16 bytes each, ZeRO 3 over 4 ranks.
    assert f"{8_030_261_248 * 16 / 4 / 2**30:,.1f} GiB per rank" in capsys.readouterr().err


def test_build_takes_a_preset_s_name():
    model = blockzoo.build("mamba2_proxy_50m")
    assert isinstance(model.config, ModelConfig) and model.config.preset == "mamba2_proxy_50m"
    assert sum(parameter.numel() for parameter in model.parameters()) == presets.get("mamba2_proxy_50m").parameters


def test_the_override_example_of_docs_models_md_does_what_it_says():
    example = yaml.safe_load(DOCS.read_text().split("```yaml\n")[1].split("```")[0])
    model = structure(example, RunConfig).model
    assert model.decoder.num_blocks == 4 and model.decoder.block.mixers["attention"].rotary.theta == 1.0e6
    assert model.decoder.block.mixers["mamba"] == presets.model_config("falcon_h1_1_5b").decoder.block.mixers["mamba"]
