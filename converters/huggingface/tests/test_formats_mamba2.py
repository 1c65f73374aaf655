"""The Mamba 2 formats (mamba2, bamba, nemotron_h) against transformers itself: import, export, both round trips,
transformers 4.x configs, and what cannot be converted.

Each case is a tiny random transformers model whose mapped fields are all away from their defaults
(hf_cases_mamba2.py); mamba_ssm is not importable here, so transformers runs its torch path.
"""

from __future__ import annotations

import pytest
import torch
from format_checks import (
    TOLERANCE,
    check_blockzoo_round_trip,
    check_export,
    check_huggingface_round_trip,
    check_import,
    comparable,
    random_model,
    read_config,
    saved_transformers_cases,
    with_config,
)
from hf_cases import hf_logits, load_hf, our_logits
from hf_cases_mamba2 import CASES, format_of

import blockzoo
from blockzoo.config import ConfigError, structure, to_dict
from blockzoo.conversion import ConversionError, checkpoint_formats, sections, unclaimed_fields
from blockzoo.model.config import ModelConfig
from blockzoo_mamba_2.huggingface import transformers_release_at_least
from blockzoo_testing import ConverterSectionConformance


@pytest.fixture(scope="module")
def hf_directories(tmp_path_factory):
    return saved_transformers_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", CASES)
def test_import_gives_the_logits_of_transformers(case, hf_directories):
    check_import(*hf_directories[case])


@pytest.mark.parametrize("case", CASES)
def test_export_loads_in_transformers_with_our_logits(case, hf_directories, tmp_path):
    check_export(hf_directories[case][0], format_of(case), tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_huggingface_to_blockzoo_to_huggingface_is_identical(case, hf_directories, tmp_path):
    directory, _ = hf_directories[case]
    expected_config = comparable(read_config(directory))
    if case == "nemotron_h_relu2":  # transformers 5 writes the pattern as its list, as the export does
        assert expected_config["layers_block_type"] == ["linear_attention", "full_attention", "mlp", "linear_attention"]
    check_huggingface_round_trip(directory, format_of(case), tmp_path, expected_config)


@pytest.mark.parametrize("case", CASES)
def test_blockzoo_to_huggingface_to_blockzoo_is_identical(case, hf_directories, tmp_path):
    check_blockzoo_round_trip(hf_directories[case][0], format_of(case), tmp_path)


INFINITY = {"__float__": "Infinity"}  # how transformers 5 writes it
OLD_NEMOTRON_H_NAMES = {
    "n_groups": "mamba_n_groups",
    "conv_kernel": "mamba_d_conv",
    "chunk_size": "mamba_chunk_size",
    "use_conv_bias": "mamba_conv_bias",
    "time_step_min": "mamba_dt_min",
}


def _legacy(config: dict) -> dict:
    """The config.json of transformers 4.x (NemotronH: of its remote code, with the names transformers 5 still
    reads): `torch_dtype`, no tagged floats; Bamba `rope_theta` and the half rotation 4.x always writes; NemotronH
    the pattern string, the `mamba_*` names and the remote code's own keys."""
    config = {key: value for key, value in config.items() if key != "dtype"}
    config["torch_dtype"] = "float32"
    if "time_step_limit" in config:
        config["time_step_limit"] = [
            float("inf") if value == INFINITY else value for value in config["time_step_limit"]
        ]
    if config["model_type"] == "bamba":
        config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
        config["partial_rotary_factor"] = 0.5
        config["mamba_d_head"] = "auto"  # expand · hidden_size / heads
    if config["model_type"] == "nemotron_h":
        names = config.pop("layers_block_type")
        characters = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
        pattern = "".join(characters[name] for name in names)
        config.update(hybrid_override_pattern=pattern, num_hidden_layers=len(pattern))
        config.update(auto_map={"AutoConfig": "configuration_nemotron_h.NemotronHConfig"}, hidden_act="relu2")
        config.update(attention_head_dim=config["head_dim"], rms_norm_eps=1e-5)
        for new, old in OLD_NEMOTRON_H_NAMES.items():
            config[old] = config.pop(new)
    return config


@pytest.mark.parametrize("case", CASES)
def test_a_transformers_4_config_imports_as_transformers_reads_it(case, hf_directories, tmp_path):
    directory, _ = hf_directories[case]
    legacy = with_config(directory, tmp_path / "legacy", _legacy(read_config(directory)))
    model = blockzoo.load(legacy)
    torch.testing.assert_close(our_logits(model), hf_logits(load_hf(legacy)), **TOLERANCE)
    expected = blockzoo.load(directory).config
    if format_of(case) == "bamba":  # 4.x's Bamba rotates half of each head, whatever the 5.x config said
        attention = expected.decoder.blocks["attention_mlp"].mixer
        assert model.config.decoder.blocks["attention_mlp"].mixer.rotary.fraction == 0.5 != attention.rotary.fraction
    else:
        assert model.config == expected


def test_nemotron_h_reads_the_layer_names_of_transformers_4(hf_directories, tmp_path):
    directory, expected = hf_directories["nemotron_h"]
    legacy = _edited(directory, tmp_path, layers_block_type=["mamba", "mlp", "attention", "mamba", "mlp"])
    model = blockzoo.load(legacy)
    assert model.config == blockzoo.load(directory).config
    torch.testing.assert_close(hf_logits(load_hf(legacy)), expected, **TOLERANCE)  # transformers reads them too


def test_export_for_transformers_4(hf_directories, tmp_path):
    # NemotronH: the pattern string of its remote code (which transformers 5 reads too).
    model = blockzoo.load(hf_directories["nemotron_h"][0])
    blockzoo.save(model, tmp_path / "nemotron_h", format="nemotron_h", transformers_version="4.57.6")
    config = read_config(tmp_path / "nemotron_h")
    assert "layers_block_type" not in config and "dtype" not in config
    assert (config["hybrid_override_pattern"], config["num_hidden_layers"]) == ("M-*M-", 5)
    assert blockzoo.load(tmp_path / "nemotron_h").config == model.config
    torch.testing.assert_close(hf_logits(load_hf(tmp_path / "nemotron_h")), our_logits(model), **TOLERANCE)
    # Bamba: 4.x rotates half of each head and has no key for it.
    bamba = blockzoo.load(hf_directories["bamba"][0])
    with pytest.raises(ConversionError, match=r"4\.x's Bamba has default RoPE on half of each head only"):
        blockzoo.save(bamba, tmp_path / "bamba_quarter", format="bamba", transformers_version="4.57.6")
    data = to_dict(bamba.config)
    data["decoder"]["blocks"]["attention_mlp"]["mixer"]["rotary"]["fraction"] = 0.5
    half = random_model(structure(data, ModelConfig), seed=5)
    blockzoo.save(half, tmp_path / "bamba", format="bamba", transformers_version="4.57.6")
    config = read_config(tmp_path / "bamba")
    assert config["rope_theta"] == 3000.0 and "rope_parameters" not in config and "rope_scaling" not in config
    torch.testing.assert_close(hf_logits(load_hf(tmp_path / "bamba")), our_logits(half), **TOLERANCE)


# The sections the attention and MLP plugins register for these formats (the Mamba 2 mixer's are checked in its
# plugin): Bamba's partial RoPE (its query and key rows permuted), NemotronH's attention and ungated MLP.


class TestBambaAttentionSectionConformance(ConverterSectionConformance):
    kind, format_name = "mixer", "bamba"

    def config_factory(self):
        rotary = {"type": "partial", "theta": 3000.0, "fraction": 0.25}
        return {
            "type": "attention",
            "heads": 4,
            "head_groups": 2,
            "head_size": 16,
            "add_linear_biases": True,
            "rotary": rotary,
        }


class TestBambaMLPSectionConformance(ConverterSectionConformance):
    kind, format_name = "mlp", "bamba"

    def config_factory(self):
        return {"type": "mlp", "intermediate_size": 24, "gated": True, "activation": "silu", "add_linear_biases": True}


class TestNemotronHAttentionSectionConformance(ConverterSectionConformance):
    kind, format_name = "mixer", "nemotron_h"

    def config_factory(self):
        return {"type": "attention", "heads": 4, "head_groups": 2, "head_size": 8, "rotary": {"type": "none"}}


class TestNemotronHMLPSectionConformance(ConverterSectionConformance):
    kind, format_name = "mlp", "nemotron_h"

    def config_factory(self):
        return {"type": "mlp", "intermediate_size": 24, "activation": "squared_relu", "add_linear_biases": True}


def test_the_layers_are_converted_by_their_sections():
    # What a blockzoo config of each format is made of, every field of it claimed.
    for format_name in ("mamba2", "bamba", "nemotron_h"):
        for config_class, section in sections(format_name).items():
            assert unclaimed_fields(section, structure({}, config_class)) == [], (format_name, config_class)
        model_section = checkpoint_formats()[format_name].model_section
        assert unclaimed_fields(model_section, ModelConfig(), claimed=("decoder",)) == []


# ---------------------------------------------------------------------------------------------------------------------
# What cannot be converted


def _edited(directory, tmp_path, **changes):
    return with_config(directory, tmp_path / "edited", {**read_config(directory), **changes})


def _export(format_name: str, data: dict) -> dict:
    return checkpoint_formats()[format_name].export_config(structure(data, ModelConfig))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"mlp_bias": True}, r"decoder.1.mlp: `mlp_bias` = true with MoE layers: NemotronH's shared experts then"),
        ({"moe_latent_size": 8}, r"decoder.1.mlp: `moe_latent_size` = 8 is not supported \(only None\)"),
        (
            {"moe_shared_expert_intermediate_size": 0},
            r"`moe_shared_expert_intermediate_size` = 0: the shared experts need",
        ),
    ],
)
def test_nemotron_h_experts_blockzoo_cannot_express_are_refused(hf_directories, tmp_path, changes, message):
    with pytest.raises(ConversionError, match=message):
        blockzoo.load(_edited(hf_directories["nemotron_h_moe"][0], tmp_path, **changes))


@pytest.mark.parametrize(
    ("case", "changes", "message"),
    [
        ("mamba2", {"hidden_act": "gelu"}, r"`hidden_act` = 'gelu' is not supported \(only 'silu'\)"),
        ("mamba2", {"expand": 2}, r"`num_heads` · `head_dim` \(8 · 12\) must equal `expand` · `hidden_size`"),
        ("bamba", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1.0, "factor": 2.0}}, "rope_type default"),
        ("bamba", {"attn_layer_indices": [3]}, r"`attn_layer_indices` must list layers in \[0, 3\)"),
        ("nemotron_h", {"num_nextn_predict_layers": 1}, r"`num_nextn_predict_layers` = 1 is not supported"),
        ("nemotron_h", {"layers_block_type": ["mamba", "sliding_attention"]}, "`layers_block_type` must list"),
        ("nemotron_h", {"mamba_hidden_act": "relu"}, r"`mamba_hidden_act` = 'relu' is not supported"),
        ("nemotron_h", {"quantization_config": {}}, r"keys 'quantization_config' are not understood"),
        ("nemotron_h", {"attention_head_dim": 16}, r"`attention_head_dim` = 16 and `head_dim` = 12: the remote code"),
    ],
)
def test_a_config_blockzoo_cannot_express_is_refused(case, changes, message, hf_directories, tmp_path):
    with pytest.raises(ConversionError, match=message):
        blockzoo.load(_edited(hf_directories[case][0], tmp_path, **changes))


def test_a_partial_rotation_of_an_odd_number_of_channels_is_refused(hf_directories, tmp_path):
    rope = {"rope_type": "default", "rope_theta": 3000.0, "partial_rotary_factor": 0.1875}  # 3 of 16 channels
    with pytest.raises(ConfigError, match=r"rotary.fraction: rotates int\(fraction · head_size\) = 3 channels"):
        blockzoo.load(_edited(hf_directories["bamba"][0], tmp_path, rope_parameters=rope))


def _mixer(data: dict, block: str | None = None) -> dict:
    decoder = data["decoder"]
    return (decoder["block"] if block is None else decoder["blocks"][block])["mixer"]


def test_a_model_the_format_cannot_hold_is_refused(hf_directories):
    mamba2 = to_dict(blockzoo.load(hf_directories["mamba2"][0]).config)
    norm = _mixer(mamba2)["normalization"]  # as the installed transformers normalizes (per group since 5.23)
    norm["per_group"] = not norm["per_group"]
    with pytest.raises(ConversionError, match=r"per_group` = \w+ with 2 groups cannot be written: the format"):
        _export("mamba2", mamba2)
    _mixer(mamba2).update(groups=1)  # one group: the two norms are the same
    assert _export("mamba2", mamba2)["n_groups"] == 1
    _mixer(mamba2).update(heads=5)  # 60 channels, not a multiple of the hidden size 32
    with pytest.raises(ConversionError, match=r"Mamba 2 inner sizes .* \[60\] cannot be written"):
        _export("mamba2", mamba2)

    nemotron = to_dict(blockzoo.load(hf_directories["nemotron_h"][0]).config)
    with pytest.raises(ConversionError, match="never ties the output weight"):
        _export("nemotron_h", {**nemotron, "tied_embedding_weight": True})
    limit = _mixer(nemotron, "mamba_2_none")["dt_limit"]
    _mixer(nemotron, "mamba_2_none")["dt_limit"] = [0.3, 2.0]
    if transformers_release_at_least((5, 25)):  # NemotronH reads `time_step_limit` since then
        assert _export("nemotron_h", nemotron)["time_step_limit"] == [0.3, 2.0]
    else:
        with pytest.raises(ConversionError, match=r"clamps the time step to \[time_step_min, inf\), with no upper"):
            _export("nemotron_h", nemotron)
    _mixer(nemotron, "mamba_2_none")["dt_limit"] = limit
    nemotron["decoder"]["blocks"]["attention_none"]["mlp"] = {"type": "mlp", "intermediate_size": 8}
    with pytest.raises(ConversionError, match=r"decoder.2: a block of mixer 'attention' and MLP 'mlp' .* split"):
        _export("nemotron_h", nemotron)

    bamba = to_dict(blockzoo.load(hf_directories["bamba"][0]).config)
    rotary = _mixer(bamba, "attention_mlp")["rotary"]
    _mixer(bamba, "attention_mlp")["rotary"] = {"type": "yarn"}
    with pytest.raises(ConversionError, match=r"`rotary` type 'yarn' cannot be written \(only default and partial\)"):
        _export("bamba", bamba)
    _mixer(bamba, "attention_mlp")["rotary"] = rotary
    bamba["decoder"]["blocks"]["mamba_2_mlp"]["mlp"] = {"type": "none"}
    with pytest.raises(ConversionError, match=r"decoder.0: a block of mixer 'mamba_2' and MLP 'none' cannot be"):
        _export("bamba", bamba)
