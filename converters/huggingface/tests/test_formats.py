"""Every format against transformers itself: import, export, both round trips, and 4.x configs.

Each case is a tiny random transformers model whose mapped fields are all away from their defaults (hf_cases.py).
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
    read_tensors,
    saved_transformers_cases,
    with_config,
)
from hf_cases import CASES, format_of, our_logits

import blockzoo


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
    expected_config = _as_written(comparable(read_config(directory)))
    check_huggingface_round_trip(directory, format_of(case), tmp_path, expected_config)


def _as_written(config: dict) -> dict:
    """The original config in the form the export writes the same model."""
    config = dict(config)
    if config.get("head_dim") is None:  # implied: made explicit
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    if "num_local_experts" in config and config["model_type"] == "qwen3_moe":  # the name both versions read
        config["num_experts"] = config.pop("num_local_experts")
    if config["model_type"] == "qwen2_moe":  # read only without `layer_types`, which blockzoo writes
        del config["max_window_layers"]
    if config.get("decoder_sparse_step", 1) > 1:  # a step becomes the list of the dense layers
        step = config.pop("decoder_sparse_step")
        dense = [i for i in range(config["num_hidden_layers"]) if (i + 1) % step or i in config["mlp_only_layers"]]
        config.update(decoder_sparse_step=1, mlp_only_layers=dense)
    return config


@pytest.mark.parametrize("case", CASES)
def test_blockzoo_to_huggingface_to_blockzoo_is_identical(case, hf_directories, tmp_path):
    check_blockzoo_round_trip(hf_directories[case][0], format_of(case), tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_a_transformers_4_config_imports_the_same_model(case, hf_directories, tmp_path):
    directory, expected = hf_directories[case]
    config = read_config(directory)
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope == {"rope_type": "default"} else rope
    config["torch_dtype"] = config.pop("dtype")
    if "num_local_experts" in config and case != "mixtral":
        config["num_experts"] = config.pop("num_local_experts")
    model = blockzoo.load(with_config(directory, tmp_path / "legacy", config))
    assert model.config == blockzoo.load(directory).config
    torch.testing.assert_close(our_logits(model), expected, **TOLERANCE)


def test_export_for_transformers_4_writes_rope_theta_and_rope_scaling(hf_directories, tmp_path):
    model = blockzoo.load(hf_directories["llama_llama3"][0])
    blockzoo.save(model, tmp_path / "hf", format="llama", transformers_version="4.57.6")
    config = read_config(tmp_path / "hf")
    assert "rope_parameters" not in config and "dtype" not in config
    assert config["rope_theta"] == 5000.0 and config["torch_dtype"] == "float32"
    assert config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 2.0,
        "high_freq_factor": 6.0,
        "original_max_position_embeddings": 64,
    }
    assert blockzoo.load(tmp_path / "hf").config == model.config


def test_moe_experts_are_written_one_tensor_per_expert(hf_directories, tmp_path):
    model = blockzoo.load(hf_directories["mixtral"][0])
    blockzoo.save(model, tmp_path / "hf", format="mixtral")
    names = read_tensors(tmp_path / "hf").keys()
    layer = "model.layers.0.block_sparse_moe"
    expected = {f"{layer}.experts.{e}.{w}.weight" for e in range(4) for w in ("w1", "w2", "w3")}
    assert expected | {f"{layer}.gate.weight"} == {name for name in names if name.startswith(layer)}
