"""Every format against transformers itself: import, export, both round trips, and 4.x configs.

Each case is a tiny random transformers model whose mapped fields are all away from their defaults (hf_cases.py).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hf_cases import CASES, format_of, hf_logits, load_hf, our_logits, save_hf_model
from safetensors.torch import load_file

import blockzoo
from blockzoo.config import to_dict
from blockzoo.model.factory import convert
from blockzoo_huggingface import versions

# Keys blockzoo does not carry: they do not change what the model computes (docs/huggingface.md).
NOT_CARRIED = {
    "max_position_embeddings",
    "initializer_range",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "use_cache",
    "output_router_logits",
    "transformers_version",
}
TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}


@pytest.fixture(scope="module")
def hf_directories(tmp_path_factory):
    """case -> (directory of the saved transformers model, its logits)."""
    directories = {}
    for case in CASES:
        directory = tmp_path_factory.mktemp(case)
        model = save_hf_model(case, directory)
        directories[case] = (directory, hf_logits(model))
    return directories


def _tensors(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def _config(directory) -> dict:
    return json.loads((directory / "config.json").read_text())


def _comparable(config: dict) -> dict:
    """The 5.x form of a config, without the keys blockzoo does not carry."""
    standard = versions.standardize(config, default_rope_theta=None)
    return {key: value for key, value in standard.items() if key not in NOT_CARRIED | {"dtype"}}


@pytest.mark.parametrize("case", CASES)
def test_import_gives_the_logits_of_transformers(case, hf_directories):
    directory, expected = hf_directories[case]
    model = blockzoo.load(directory)
    torch.testing.assert_close(our_logits(model), expected, **TOLERANCE)


@pytest.mark.parametrize("case", CASES)
def test_export_loads_in_transformers_with_our_logits(case, hf_directories, tmp_path):
    # A blockzoo model of the architecture with blockzoo's own random weights, not transformers'.
    config = blockzoo.load(hf_directories[case][0]).config
    model = blockzoo.build({"model": to_dict(config), "distributed": {"seed": 7}})
    blockzoo.save(model, tmp_path / "hf", format=format_of(case))
    torch.testing.assert_close(hf_logits(load_hf(tmp_path / "hf")), our_logits(model), **TOLERANCE)


@pytest.mark.parametrize("case", CASES)
def test_huggingface_to_blockzoo_to_huggingface_is_identical(case, hf_directories, tmp_path):
    directory, _ = hf_directories[case]
    # Through a native checkpoint (streaming) and through a model in memory.
    convert(directory, tmp_path / "native")
    convert(tmp_path / "native", tmp_path / "streamed", format=format_of(case))
    blockzoo.save(blockzoo.load(directory), tmp_path / "saved", format=format_of(case))
    original = _tensors(directory)
    for written in ("streamed", "saved"):
        tensors = _tensors(tmp_path / written)
        assert tensors.keys() == original.keys()
        for name, tensor in original.items():
            assert torch.equal(tensors[name], tensor), name
        assert _comparable(_config(tmp_path / written)) == _as_written(_comparable(_config(directory)))
        assert blockzoo.load(tmp_path / written).config == blockzoo.load(directory).config


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
    config = blockzoo.load(hf_directories[case][0]).config
    model = blockzoo.build({"model": to_dict(config), "distributed": {"seed": 3}})
    blockzoo.save(model, tmp_path / "hf", format=format_of(case))
    loaded = blockzoo.load(tmp_path / "hf")
    assert loaded.config == model.config
    parameters = dict(model.named_parameters())
    assert {name for name, _ in loaded.named_parameters()} == parameters.keys()
    for name, parameter in loaded.named_parameters():
        assert torch.equal(parameter, parameters[name]), name


@pytest.mark.parametrize("case", CASES)
def test_a_transformers_4_config_imports_the_same_model(case, hf_directories, tmp_path):
    directory, expected = hf_directories[case]
    config = _config(directory)
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope == {"rope_type": "default"} else rope
    config["torch_dtype"] = config.pop("dtype")
    if "num_local_experts" in config and case != "mixtral":
        config["num_experts"] = config.pop("num_local_experts")
    legacy = tmp_path / "legacy"
    shutil.copytree(directory, legacy)
    (legacy / "config.json").write_text(json.dumps(config))
    model = blockzoo.load(legacy)
    assert model.config == blockzoo.load(directory).config
    torch.testing.assert_close(our_logits(model), expected, **TOLERANCE)


def test_export_for_transformers_4_writes_rope_theta_and_rope_scaling(hf_directories, tmp_path):
    model = blockzoo.load(hf_directories["llama_llama3"][0])
    blockzoo.save(model, tmp_path / "hf", format="llama", transformers_version="4.57.6")
    config = _config(tmp_path / "hf")
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
    names = _tensors(tmp_path / "hf").keys()
    layer = "model.layers.0.block_sparse_moe"
    expected = {f"{layer}.experts.{e}.{w}.weight" for e in range(4) for w in ("w1", "w2", "w3")}
    assert expected | {f"{layer}.gate.weight"} == {name for name in names if name.startswith(layer)}
