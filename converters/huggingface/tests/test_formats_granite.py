"""The Granite-4.0 hybrid format (granitemoehybrid) against transformers itself: import, export, both round trips,
a transformers 4.x config, the multipliers each mapped to its own field, and what cannot be converted.

Each case is a tiny random transformers model whose mapped fields are all away from their defaults
(hf_cases_granite.py); mamba_ssm is not importable here, so transformers runs its torch path.
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
    read_config,
    saved_transformers_cases,
    with_config,
)
from hf_cases import our_logits
from hf_cases_granite import CASES, format_of

import blockzoo
from blockzoo.config import structure, to_dict
from blockzoo.conversion import ConversionError, get_format, sections, unclaimed_fields
from blockzoo.model.config import ModelConfig
from blockzoo.model.factory import convert


@pytest.fixture(scope="module")
def hf_directories(tmp_path_factory):
    return saved_transformers_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", CASES)
def test_import_gives_the_logits_of_transformers(case, hf_directories):
    check_import(*hf_directories[case])


@pytest.mark.parametrize("case", CASES)
def test_export_loads_in_transformers_with_our_logits(case, hf_directories, tmp_path):
    check_export(hf_directories[case][0], format_of(case), tmp_path)


def test_huggingface_to_blockzoo_to_huggingface_is_identical(hf_directories, tmp_path):
    directory, _ = hf_directories["granitemoehybrid"]
    check_huggingface_round_trip(directory, "granitemoehybrid", tmp_path, comparable(read_config(directory)))


@pytest.mark.parametrize("case", CASES)
def test_blockzoo_to_huggingface_to_blockzoo_is_identical(case, hf_directories, tmp_path):
    check_blockzoo_round_trip(hf_directories[case][0], format_of(case), tmp_path)


def test_the_multipliers_are_their_own_fields(hf_directories):
    config = blockzoo.load(hf_directories["granitemoehybrid"][0]).config
    assert config.embeddings.multiplier == 3.0
    assert config.head.logits_multiplier == 1 / 4.0
    blocks = [block for _, block in config.decoder.expanded_blocks()]
    assert {block.residual_multiplier for block in blocks} == {0.6}
    assert blocks[1].mixer.softmax_scale == 0.15 and blocks[1].mixer.head_size == 32 // 4
    assert blocks[0].mlp.shared_intermediate_size == 40 and blocks[0].mlp.norm_topk_prob


def test_a_transformers_4_config_imports_the_same_model(hf_directories, tmp_path):
    directory, expected = hf_directories["granitemoehybrid"]
    config = read_config(directory)
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None
    config["torch_dtype"] = config.pop("dtype")
    config["time_step_limit"] = [0.3, 0.9]
    config["layer_types"] = ["mamba", "attention", "mamba"]  # transformers 4.x's names
    model = blockzoo.load(with_config(directory, tmp_path / "legacy", config))
    assert model.config == blockzoo.load(directory).config
    torch.testing.assert_close(our_logits(model), expected, **TOLERANCE)


def test_export_for_transformers_4_writes_its_layer_names(hf_directories, tmp_path):
    model = blockzoo.load(hf_directories["granitemoehybrid"][0])
    blockzoo.save(model, tmp_path / "hf", format="granitemoehybrid", transformers_version="4.57.6")
    config = read_config(tmp_path / "hf")
    assert config["layer_types"] == ["mamba", "attention", "mamba"] and "rope_theta" in config
    # The same model but the Mamba layers' gated norm, over the whole inner dimension in transformers 4.x (Bamba's).
    loaded = blockzoo.load(tmp_path / "hf").config
    mamba_layers = loaded.decoder.expanded_blocks()[::2]
    assert [block.mixer.normalization.per_group for _, block in mamba_layers] == [False, False]
    assert loaded.embeddings == model.config.embeddings and loaded.head == model.config.head


def test_every_field_of_every_converted_config_class_is_claimed():
    registered = sections("granitemoehybrid")
    assert {cls.__name__ for cls in registered} >= {
        "AttentionConfig",
        "Mamba2Config",
        "MoEMLPConfig",
        "DecoderBlockConfig",
        "RMSNormalizationConfig",
    }
    for config_class, section in registered.items():
        assert unclaimed_fields(section, structure({}, config_class)) == [], config_class.__name__


def test_what_granite_cannot_express_is_refused(hf_directories, tmp_path):
    directory, _ = hf_directories["granitemoehybrid"]
    config = read_config(directory)
    with pytest.raises(ConversionError, match="num_local_experts` = 0"):
        blockzoo.load(with_config(directory, tmp_path / "dense", {**config, "num_local_experts": 0}))
    model = to_dict(blockzoo.load(directory).config)
    model["decoder"]["blocks"]["attention_moe"]["mlp"]["shared_expert_gate"] = {}
    with pytest.raises(ConversionError, match="one ungated shared MLP"):
        get_format("granitemoehybrid").export_config(structure(model, ModelConfig))
    convert(directory, tmp_path / "native")  # a native checkpoint of it converts back (streaming)
    convert(tmp_path / "native", tmp_path / "back", format="granitemoehybrid")
    assert blockzoo.load(tmp_path / "back").config == blockzoo.load(directory).config
