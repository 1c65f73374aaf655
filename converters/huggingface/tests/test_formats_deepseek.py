"""The deepseek_v3 format against transformers itself: import gives its logits, export loads in it with ours, both
round trips are identical, a transformers 4.x config imports the same model, and what the format cannot express is
refused.

Each case is a tiny random DeepseekV3ForCausalLM whose mapped fields are away from their defaults
(hf_cases_deepseek.py).
"""

from __future__ import annotations

import attrs
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
from hf_cases_deepseek import CASES, format_of

import blockzoo
from blockzoo.config import structure, to_dict
from blockzoo.conversion import ConversionError, checkpoint_formats
from blockzoo.model.config import ModelConfig

# YaRN's config comes back equivalent, not identical: `attention_factor` and the `mscale_all_dim` of the softmax scale
# in place of `mscale` (see blockzoo_mla.huggingface).
ROUND_TRIPS = [case for case in CASES if case != "deepseek_v3_yarn"]


@pytest.fixture(scope="module")
def hf_directories(tmp_path_factory):
    return saved_transformers_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", CASES)
def test_import_gives_the_logits_of_transformers(case, hf_directories):
    check_import(*hf_directories[case])


@pytest.mark.parametrize("case", CASES)
def test_export_loads_in_transformers_with_our_logits(case, hf_directories, tmp_path):
    check_export(hf_directories[case][0], format_of(case), tmp_path)


@pytest.mark.parametrize("case", ROUND_TRIPS)
def test_huggingface_to_blockzoo_to_huggingface_is_identical(case, hf_directories, tmp_path):
    directory, _ = hf_directories[case]
    expected = comparable(read_config(directory))
    if expected["first_k_dense_replace"] == 0:  # no dense layer holds the dense MLPs' width: not written
        del expected["intermediate_size"]
    check_huggingface_round_trip(directory, format_of(case), tmp_path, expected)


@pytest.mark.parametrize("case", ROUND_TRIPS)
def test_blockzoo_to_huggingface_to_blockzoo_is_identical(case, hf_directories, tmp_path):
    check_blockzoo_round_trip(hf_directories[case][0], format_of(case), tmp_path)


def test_import_reads_the_layers(hf_directories):
    config = blockzoo.load(hf_directories["deepseek_v3"][0]).config
    blocks = [block for _, block in config.decoder.expanded_blocks()]
    assert [type(block.mlp).__name__ for block in blocks] == ["DenseMLPConfig", "MoEMLPConfig", "MoEMLPConfig"]
    mixer, moe = blocks[0].mixer, blocks[1].mlp
    assert (mixer.query_rank, mixer.key_value_rank, mixer.interleaved_rotary) == (12, 8, True)
    assert (moe.routing, moe.routing_groups, moe.routing_groups_per_token, moe.routed_scale) == (
        "sigmoid_top_k",
        3,
        2,
        1.5,
    )
    assert moe.score_correction_bias and not moe.norm_topk_prob and moe.shared_width == 32


def _model_config(directory) -> ModelConfig:
    return blockzoo.load(directory).config


def _refused(config: ModelConfig, match: str) -> None:
    with pytest.raises(ConversionError, match=match):
        checkpoint_formats()["deepseek_v3"].export_config(config)


def test_what_the_format_cannot_express_is_refused(hf_directories):
    config = _model_config(hf_directories["deepseek_v3"][0])
    data = to_dict(config)
    blocks = data["decoder"]["blocks"]
    dense, moe = (name for name in blocks if blocks[name]["mlp"]["type"] == "mlp"), None
    dense = next(dense)
    moe = next(name for name in blocks if blocks[name]["mlp"]["type"] == "moe")
    # A dense layer after a MoE layer.
    reordered = {**data, "decoder": {**data["decoder"], "pattern": [moe, dense, moe]}}
    _refused(structure(reordered, ModelConfig), r"decoder\.1: a dense MLP after a MoE layer")
    # A bias on kv_b_proj, which DeepSeek-V3 never has.
    mixer = blocks[dense]["mixer"]
    changed = {**mixer, "key_value_up": {**mixer["key_value_up"], "bias": {"enabled": True}}}
    with_bias = {
        **data,
        "decoder": {**data["decoder"], "blocks": {**blocks, dense: {**blocks[dense], "mixer": changed}}},
    }
    _refused(structure(with_bias, ModelConfig), r"MLA biases .* cannot be written")
    # A softmax scale other than the format's, without YaRN.
    scaled = attrs.evolve(config.decoder.blocks[dense].mixer, softmax_scale=0.5)
    block = attrs.evolve(config.decoder.blocks[dense], mixer=scaled)
    decoder = attrs.evolve(config.decoder, blocks={**config.decoder.blocks, dense: block})
    _refused(attrs.evolve(config, decoder=decoder), r"`softmax_scale` 0.5 cannot be written")


@pytest.mark.parametrize("case", CASES)
def test_a_transformers_4_config_imports_the_same_model(case, hf_directories, tmp_path):
    # transformers 4.x writes `rope_theta` and `rope_scaling` (DeepSeek's YaRN with `type` and its mscale keys).
    directory, expected = hf_directories[case]
    config = read_config(directory)
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope == {"rope_type": "default"} else rope
    config["torch_dtype"] = config.pop("dtype")
    model = blockzoo.load(with_config(directory, tmp_path / "legacy", config))
    assert model.config == blockzoo.load(directory).config
    torch.testing.assert_close(our_logits(model), expected, **TOLERANCE)
