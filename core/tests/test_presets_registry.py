"""Presets with the core alone: registration by plugins (a third party's, conflicts, names, a plugin of an older API
without the hook), `model: {preset: ...}` with overrides and their errors, `blockzoo models`, `blockzoo init PRESET`
and `blockzoo config` through the CLI, the memory estimate. The first-party catalogue (every plugin installed):
tests/test_presets_catalogue.py; the checks against transformers:
converters/huggingface/tests/test_presets_against_transformers.py."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
import yaml

import blockzoo
from blockzoo import memory, plugins, preset_catalogue, presets
from blockzoo.api import PluginInfo, Preset, hookimpl
from blockzoo.cli import main
from blockzoo.config import ConfigError, load, structure, to_yaml
from blockzoo.errors import UsageError
from blockzoo.plugins import PLUGIN_API, PluginRecord, Registry, register_plugin
from blockzoo.run_config import RunConfig

DOCS = Path(__file__).parents[2] / "docs" / "models.md"

# A third party's architecture, written as blockzoo model-config data of the core's own types (no mixer, no MLP:
# the core alone has no other), and its parameters counted by hand: the embedding table, the output weight (untied)
# and the final norm.
VOCAB, HIDDEN, LAYERS = 256, 32, 3
TINY = {
    "hidden_size": HIDDEN,
    "embeddings": {"vocab_size": VOCAB},
    "decoder": {
        "type": "fixed",
        "num_blocks": LAYERS,
        "block": {"mixer": {"type": "none"}, "mlp": {"type": "none"}, "normalization": {"epsilon": 1.0e-6}},
    },
}
TINY_PARAMETERS = 2 * VOCAB * HIDDEN + HIDDEN


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
        requires=("blockzoo",),
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
    register("acme.far", tiny(requires=("blockzoo", "blockzoo-not-installed")))
    code, out, _ = run_cli(capsys, "models")
    line = next(line for line in out.splitlines() if line.startswith("acme.far"))
    assert code == 0 and line.endswith("no: pip install blockzoo-not-installed")
    with pytest.raises(ConfigError, match=r"model.preset: preset 'acme.far' needs blockzoo-not-installed"):
        structure({"model": {"preset": "acme.far"}}, RunConfig)
    code, _, err = run_cli(capsys, "init", "acme.far", "--output", str(tmp_path / "far.yaml"))
    assert code == 2 and "pip install blockzoo-not-installed" in err and not (tmp_path / "far.yaml").exists()


def test_a_plugin_of_an_older_plugin_api_without_the_hook_loads_unchanged(fresh_registry):
    assert PLUGIN_API >= (1, 2)
    for version in ((1, 0), (1, 1)):
        record = register_plugin(plugin(api_version=version), f"old{version[1]}")
        assert record.status == "loaded", record.error
    assert presets.names() == sorted(presets.names())


def test_overrides_merge_into_the_preset_s_own_types(fresh_registry):
    register("acme.tiny", tiny())
    preset = presets.model_config("acme.tiny")
    changed = presets.model_config("acme.tiny", {"decoder": {"num_blocks": 1}, "embeddings": {"vocab_size": 512}})
    assert changed.decoder.num_blocks == 1 and preset.decoder.num_blocks == LAYERS
    assert changed.embeddings.vocab_size == 512 and changed.hidden_size == HIDDEN
    # The block keeps the preset's own types and values (its norm's epsilon is not the default).
    assert changed.decoder.block == preset.decoder.block and preset.decoder.block.normalization.epsilon == 1.0e-6
    assert changed.preset == "acme.tiny"


def test_a_preset_run_config_round_trips_through_its_explicit_form(fresh_registry):
    register("acme.tiny", tiny())
    run_config = structure({"model": {"preset": "acme.tiny", "decoder": {"num_blocks": 1}}}, RunConfig)
    explicit = yaml.safe_load(to_yaml(run_config, explicit_only=True))
    # The preset and the sections given (whole: they were completed from the preset), not the rest of the model.
    assert explicit["model"]["preset"] == "acme.tiny" and explicit["model"]["decoder"]["num_blocks"] == 1
    assert "hidden_size" not in explicit["model"] and "embeddings" not in explicit["model"]
    assert structure(explicit, RunConfig) == run_config


@pytest.mark.parametrize(
    ("model", "path", "message"),
    [
        ({"preset": "acme.tiyn"}, "model.preset", "unknown preset 'acme.tiyn'; did you mean 'acme.tiny'?"),
        ({"preset": 3}, "model.preset", "a preset name is a string"),
        ({"preset": "acme.tiny", "pretrained": "somewhere"}, "model.preset", "either a preset or a pretrained"),
        (
            {"preset": "acme.tiny", "decoder": {"block": {"normalization": {"epsilom": 1}}}},
            "model.decoder.block.normalization.epsilom",
            "",
        ),
        ({"preset": "acme.tiny", "decoder": {"num_blocks": 0}}, "model.decoder.num_blocks", ""),
    ],
)
def test_override_errors_name_the_field(fresh_registry, model, path, message):
    register("acme.tiny", tiny())
    with pytest.raises(ConfigError) as raised:
        structure({"model": model}, RunConfig)
    assert any(where == path and message in text for where, text in raised.value.errors), raised.value.errors


def test_blockzoo_models_lists_every_preset_with_its_counts(fresh_registry, capsys):
    register("acme.tiny", tiny(active_parameters=TINY_PARAMETERS // 2, published_parameters="16K"))
    code, out, _ = run_cli(capsys, "models")
    header, *lines = out.splitlines()
    rows = {line.split()[0]: line.split() for line in lines}
    assert code == 0 and header.split() == list(preset_catalogue.COLUMNS) and sorted(rows) == presets.names()
    assert rows["acme.tiny"] == ["acme.tiny", "Acme", "16.4K", "8.21K", "16K", "acme", "-", "yes"]


def test_blockzoo_init_writes_a_run_config_that_blockzoo_config_checks(fresh_registry, capsys, tmp_path):
    big = 8_000_000_000  # stated, not built: init sizes the layout from the preset's count
    register("acme.tiny", tiny(parameters=big))
    output = tmp_path / "run.yaml"
    code, _, err = run_cli(capsys, "init", "acme.tiny", "--output", str(output))
    assert code == 0 and "the acme.tiny preset" in err
    run_config = load(RunConfig, output)
    assert run_config.model == presets.model_config("acme.tiny") and run_config.distributed.zero_stage == 3
    # 16 bytes a parameter, 48 GiB of each GPU: 8e9 × 16 / 48 GiB = 2.48, so 4 processes (a power of two).
    assert "--nproc-per-node 4" in output.read_text() and "8,000,000,000 parameters" in output.read_text()
    code, out, err = run_cli(capsys, "config", str(output), "--processes", "4")
    assert code == 0 and "preset: acme.tiny" in out
    # What the model built holds (not the stated count), 16 bytes a parameter, ZeRO 3 over 4 ranks.
    assert f"{TINY_PARAMETERS * 16 / 4 / 2**30:,.1f} GiB per rank" in err
    code, _, err = run_cli(capsys, "init", "acme.tiny", "--output", str(output))
    assert code == 2 and "exists" in err


def test_a_small_preset_runs_on_one_process(fresh_registry, capsys, tmp_path):
    register("acme.tiny", tiny())
    output = tmp_path / "small.yaml"
    assert run_cli(capsys, "init", "acme.tiny", "-o", str(output))[0] == 0
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


def test_a_saved_model_records_its_preset_and_loads_where_the_preset_is_gone(fresh_registry, tmp_path):
    register("acme.tiny", tiny())
    model = blockzoo.build({"model": {"preset": "acme.tiny", "decoder": {"num_blocks": 1}}})
    blockzoo.save(model, tmp_path / "checkpoint")
    assert yaml.safe_load((tmp_path / "checkpoint" / "config.yaml").read_text())["model"]["preset"] == "acme.tiny"
    plugins.reset_registry()  # the plugin that registered the preset is gone: the checkpoint's config is complete
    loaded = blockzoo.load(tmp_path / "checkpoint")
    assert loaded.config == model.config and "acme.tiny" not in presets.names()
    tokens = torch.randint(0, VOCAB, (1, 7))
    assert torch.equal(loaded.eval()(tokens), model.eval()(tokens))
