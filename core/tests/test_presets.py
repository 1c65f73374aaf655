"""Presets: registration by plugins (a third party's, conflicts, names, a plugin of an older API without the hook),
`model: {preset: ...}` with overrides and their errors, `blockzoo models`, `blockzoo init PRESET` and `blockzoo config`
through the CLI, the memory estimate, and docs/models.md kept current. The checks against transformers are
converters/huggingface/tests/test_presets.py."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import yaml

import blockzoo
from blockzoo import memory, plugins, preset_catalogue, presets
from blockzoo.api import PluginInfo, Preset, hookimpl
from blockzoo.cli import main
from blockzoo.config import ConfigError, load, structure, to_dict, to_yaml
from blockzoo.errors import UsageError
from blockzoo.model.config import ModelConfig
from blockzoo.plugins import PLUGIN_API, PluginRecord, Registry, register_plugin
from blockzoo.run_config import RunConfig

DOCS = Path(__file__).parents[2] / "docs" / "models.md"

# A third party's architecture, written as blockzoo model-config data.
VOCAB, HIDDEN, HEADS, HEAD_GROUPS, HEAD_SIZE, INTERMEDIATE, LAYERS = 256, 32, 4, 2, 8, 64, 3
TINY = {
    "hidden_size": HIDDEN,
    "tied_embedding_weight": True,
    "embeddings": {"vocab_size": VOCAB},
    "decoder": {
        "type": "fixed",
        "num_blocks": LAYERS,
        "block": {
            "mixer": {"type": "attention", "heads": HEADS, "head_groups": HEAD_GROUPS, "head_size": HEAD_SIZE},
            "mlp": {"type": "mlp", "intermediate_size": INTERMEDIATE, "gated": True},
        },
    },
}
# Counted by hand: the embedding (tied), per layer the query, key, value and output projections, the gated MLP's
# three matrices and two norms, and the final norm.
TINY_PARAMETERS = (
    VOCAB * HIDDEN
    + LAYERS
    * (HIDDEN * HEADS * HEAD_SIZE * 2 + HIDDEN * HEAD_GROUPS * HEAD_SIZE * 2 + 3 * HIDDEN * INTERMEDIATE + 2 * HIDDEN)
    + HIDDEN
)


def plugin(api_version=PLUGIN_API, **hooks) -> types.ModuleType:
    module = types.ModuleType("test_presets_plugin")
    module.plugin_info = hookimpl(specname="plugin_info")(lambda: PluginInfo(api_version=api_version))
    for name, function in hooks.items():
        setattr(module, name, hookimpl(specname=name)(function))
    return module


def tiny(**changes) -> Preset:
    fields = dict(
        family="Acme",
        config=TINY,
        parameters=TINY_PARAMETERS,
        source="ours: a test architecture",
        requires=("blockzoo-attention", "blockzoo-mlp"),
    )
    return Preset(**(fields | changes))


def register(name, preset, plugin_name="acme"):
    return register_plugin(plugin(register_presets=lambda register: register(name, preset)), plugin_name)


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_third_party_preset_is_listed_and_builds_the_architecture_it_states(fresh_registry, capsys):
    record = register("acme.tiny", tiny())
    assert record.status == "loaded", record.error
    code, out, _ = run_cli(capsys, "models", "--json")
    row = next(row for row in json.loads(out) if row["name"] == "acme.tiny")
    assert code == 0 and row["plugin"] == "acme" and row["available"] and row["published_parameters"] is None
    model = blockzoo.build("acme.tiny")
    assert sum(parameter.numel() for parameter in model.parameters()) == TINY_PARAMETERS
    assert presets.get("acme.tiny").ours


def test_a_third_party_preset_name_carries_its_plugin_name():
    registry = Registry()
    record = PluginRecord(name="acme", distribution="blockzoo-acme", version="1.0")
    registry.add_plugin(plugin(register_presets=lambda register: register("tiny", tiny())), record)
    assert record.status == "failed" and "must be 'acme.<name>'" in record.error
    assert registry.presets == {}


def test_a_preset_registered_by_two_plugins_is_used_by_neither(monkeypatch):
    registry = Registry()
    for distribution in ("blockzoo-acme", "acme-fork"):
        record = PluginRecord(name="acme", distribution=distribution, version="1.0")
        registry.add_plugin(plugin(register_presets=lambda register: register("acme.tiny", tiny())), record)
    monkeypatch.setattr(plugins, "_registry", registry)
    monkeypatch.setenv("BLOCKZOO_STRICT_PLUGINS", "0")  # strict mode refuses the registry outright (its problems)
    with pytest.raises(UsageError, match=r"registered by both 'acme' \(blockzoo-acme 1.0\) and 'acme' \(acme-fork"):
        presets.get("acme.tiny")
    assert any(line.startswith("preset 'acme.tiny' is registered by both") for line in registry.problems())


def test_a_preset_needing_a_missing_distribution_is_listed_with_what_to_install(fresh_registry, capsys, tmp_path):
    register("acme.far", tiny(requires=("blockzoo-attention", "blockzoo-not-installed")))
    code, out, _ = run_cli(capsys, "models")
    line = next(line for line in out.splitlines() if line.startswith("acme.far"))
    assert code == 0 and line.endswith("no: pip install blockzoo-not-installed")
    with pytest.raises(ConfigError, match=r"model.preset: preset 'acme.far' needs blockzoo-not-installed"):
        structure({"model": {"preset": "acme.far"}}, RunConfig)
    code, _, err = run_cli(capsys, "init", "acme.far", "--output", str(tmp_path / "far.yaml"))
    assert code == 2 and "pip install blockzoo-not-installed" in err and not (tmp_path / "far.yaml").exists()


def test_a_plugin_of_an_older_plugin_api_without_the_hook_loads_unchanged(fresh_registry):
    assert PLUGIN_API == (1, 2)
    for version in ((1, 0), (1, 1)):
        record = register_plugin(plugin(api_version=version), f"old{version[1]}")
        assert record.status == "loaded", record.error
    assert "qwen3_0_6b" in presets.names()  # the first-party presets are still there


def test_overrides_merge_into_the_preset_s_own_types():
    preset = presets.model_config("qwen3_proxy_125m")
    changes = {"decoder": {"num_blocks": 2, "block": {"mixer": {"rotary": {"theta": 5.0e6}}}}}
    changed = presets.model_config("qwen3_proxy_125m", changes)
    assert changed.decoder.num_blocks == 2 and preset.decoder.num_blocks == 12
    mixer, original = changed.decoder.block.mixer, preset.decoder.block.mixer
    assert mixer.rotary.theta == 5.0e6 and type(mixer.rotary) is type(original.rotary)
    # Everything not overridden is the preset's: the query/key norms, head sizes, the MLP.
    assert to_dict(mixer) | {"rotary": None} == to_dict(original) | {"rotary": None}
    assert changed.decoder.block.mlp == preset.decoder.block.mlp and changed.embeddings == preset.embeddings


def test_a_preset_run_config_round_trips_through_its_explicit_form():
    run_config = structure({"model": {"preset": "llama3_proxy_200m", "decoder": {"num_blocks": 3}}}, RunConfig)
    explicit = yaml.safe_load(to_yaml(run_config, explicit_only=True))
    # The preset and the sections given (whole: they were completed from the preset), not the rest of the model.
    assert explicit["model"]["preset"] == "llama3_proxy_200m" and explicit["model"]["decoder"]["num_blocks"] == 3
    assert "hidden_size" not in explicit["model"] and "embeddings" not in explicit["model"]
    assert structure(explicit, RunConfig) == run_config


@pytest.mark.parametrize(
    ("model", "path", "message"),
    [
        ({"preset": "qwen3_0_6x"}, "model.preset", "unknown preset 'qwen3_0_6x'; did you mean 'qwen3_0_6b'?"),
        ({"preset": 3}, "model.preset", "a preset name is a string"),
        ({"preset": "qwen3_0_6b", "pretrained": "somewhere"}, "model.preset", "either a preset or a pretrained"),
        ({"preset": "qwen3_0_6b", "decoder": {"block": {"mixer": {"heds": 4}}}}, "model.decoder.block.mixer.heds", ""),
        ({"preset": "qwen3_0_6b", "decoder": {"num_blocks": 0}}, "model.decoder.num_blocks", ""),
    ],
)
def test_override_errors_name_the_field(model, path, message):
    with pytest.raises(ConfigError) as raised:
        structure({"model": model}, RunConfig)
    assert any(where == path and message in text for where, text in raised.value.errors), raised.value.errors


def test_blockzoo_models_lists_every_preset_with_its_counts(capsys):
    code, out, _ = run_cli(capsys, "models")
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert code == 0 and sorted(lines) == presets.names()
    assert "46.7B" in lines["mixtral_8x7b"] and "12.9B" in lines["mixtral_8x7b"] and "mixtral" in lines["mixtral_8x7b"]
    assert " ours " in lines["qwen3_proxy_125m"]


def test_blockzoo_init_writes_a_run_config_that_blockzoo_config_checks(capsys, tmp_path):
    output = tmp_path / "run.yaml"
    code, _, err = run_cli(capsys, "init", "llama3_1_8b", "--output", str(output))
    assert code == 0 and "the llama3_1_8b preset" in err
    run_config = load(RunConfig, output)
    assert run_config.model == presets.model_config("llama3_1_8b")
    assert run_config.distributed.zero_stage == 3
    text = output.read_text()
    assert "--nproc-per-node 4" in text and "8,030,261,248 parameters" in text
    code, out, err = run_cli(capsys, "config", str(output), "--processes", "4")
    assert code == 0 and "preset: llama3_1_8b" in out
    # 16 bytes a parameter, ZeRO 3 over 4 ranks: 8,030,261,248 × 16 / 4 bytes.
    assert f"{8_030_261_248 * 16 / 4 / 2**30:,.1f} GiB per rank" in err
    code, _, err = run_cli(capsys, "init", "llama3_1_8b", "--output", str(output))
    assert code == 2 and "exists" in err


def test_a_small_preset_runs_on_one_process(capsys, tmp_path):
    output = tmp_path / "small.yaml"
    assert run_cli(capsys, "init", "qwen3_proxy_125m", "-o", str(output))[0] == 0
    run_config = load(RunConfig, output)
    assert run_config.distributed.zero_stage == 0 and "blockzoo train THIS_FILE" in output.read_text()


def test_the_memory_estimate_splits_each_part_as_its_zero_stage_does():
    parameters = 1_000_000
    assert memory.per_rank(parameters) == memory.RankMemory(4e6, 4e6, 8e6)
    assert memory.per_rank(parameters, model_parallel=2, data_parallel=4, zero_stage=1) == memory.RankMemory(
        2e6, 2e6, 1e6
    )
    assert memory.per_rank(parameters, data_parallel=4, zero_stage=2) == memory.RankMemory(4e6, 1e6, 2e6)
    assert memory.per_rank(parameters, data_parallel=4, zero_stage=3).total == 4e6


def test_docs_models_md_is_generated_from_the_catalogue():
    expected = preset_catalogue.markdown(preset_catalogue.rows())
    assert DOCS.read_text() == expected, "regenerate: blockzoo models --markdown > docs/models.md"


def test_every_published_preset_names_its_source_and_its_published_figure():
    for name in presets.names():
        preset = presets.get(name)
        assert preset.source.startswith("https://huggingface.co/") or (preset.ours and preset.source.startswith("ours"))
        assert isinstance(presets.model_config(name), ModelConfig)
