"""Bad inputs end in an error that names what is wrong: the file, the key, the tensor, the field."""

from __future__ import annotations

import json
import shutil
import types

import pytest
from hf_cases import hf_model
from safetensors.torch import load_file, save_file

import blockzoo
from blockzoo.checkpoint import CheckpointError
from blockzoo.config import to_dict
from blockzoo.conversion import ConversionError, Rename, Section
from blockzoo.model.factory import convert
from blockzoo.plugins import hookimpl, register_plugin, reset_registry
from blockzoo_attention.config import AttentionConfig


@pytest.fixture(scope="module")
def hf_directory(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    hf_model("llama_yarn").save_pretrained(directory, max_shard_size="40KB")  # several shards and an index
    return directory


@pytest.fixture
def copy(hf_directory, tmp_path):
    destination = tmp_path / "hf"
    shutil.copytree(hf_directory, destination)
    return destination


def _edit_config(directory, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def _shards(directory):
    return sorted(directory.glob("model-*.safetensors"))


def test_the_fixture_has_shards(hf_directory):
    assert len(_shards(hf_directory)) > 2 and (hf_directory / "model.safetensors.index.json").is_file()


def test_a_truncated_safetensors_file(copy):
    shard = _shards(copy)[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ConversionError, match=rf"{shard.name}: truncated: tensor '.*' needs bytes up to"):
        blockzoo.load(copy)


def test_a_corrupted_header(copy):
    shard = _shards(copy)[0]
    shard.write_bytes(b"\xff" * 8 + shard.read_bytes()[8:])
    with pytest.raises(ConversionError, match=rf"{shard.name}: corrupted or truncated: a header of"):
        blockzoo.load(copy)


def test_a_missing_shard(copy):
    shard = _shards(copy)[1]
    shard.unlink()
    with pytest.raises(ConversionError, match=rf"{shard.name}: missing shard \(model.safetensors.index.json lists"):
        blockzoo.load(copy)


def test_an_unsupported_model_type(copy):
    _edit_config(copy, model_type="gpt2")
    with pytest.raises(CheckpointError, match=r"model_type 'gpt2', which no installed converter reads .*: .*llama"):
        blockzoo.load(copy)


def test_a_config_key_no_section_claims(copy):
    _edit_config(copy, quantization_config={"bits": 4}, frobnication=2)
    with pytest.raises(ConversionError, match=r"keys 'frobnication', 'quantization_config' are not understood"):
        blockzoo.load(copy)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "rope_type` = 'linear'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "mscale": 0.7}}, "mscale` = 0.7"),
        ({"attention_dropout": 0.1}, r"decoder.0.mixer: `attention_dropout` = 0.1 is not supported"),
        ({"hidden_act": "gelu_pytorch_tanh"}, r"decoder.0.mlp: `hidden_act` = 'gelu_pytorch_tanh' is not supported"),
        ({"pretraining_tp": 2}, r"`pretraining_tp` = 2 is not supported"),
    ],
)
def test_a_value_blockzoo_cannot_express(copy, changes, message):
    _edit_config(copy, **changes)
    with pytest.raises(ConversionError, match=message):
        blockzoo.load(copy)


def test_a_tensor_no_section_claims(copy):
    shard = _shards(copy)[0]
    tensors = load_file(shard)
    tensors["model.layers.0.self_attn.rotary_bias"] = next(iter(tensors.values())).clone()
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"'model.layers.0.self_attn.rotary_bias' claimed by no section"):
        blockzoo.load(copy)


def test_a_missing_tensor(copy):
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    shard = copy / index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    tensors = load_file(shard)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, shard, metadata={"format": "pt"})
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConversionError, match=r"'model.layers.1.mlp.up_proj.weight' missing from the checkpoint"):
        blockzoo.load(copy)


def test_tensors_of_the_wrong_shape(copy):
    _edit_config(copy, intermediate_size=80)
    with pytest.raises(ConversionError, match=r"make parameter 'decoder.0.mlp.gate_up.weight' of shape \[192, 64\]"):
        blockzoo.load(copy)


def test_pickle_checkpoints_are_not_read(copy, tmp_path):
    for path in copy.glob("model*.safetensors*"):
        path.unlink()
    (copy / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConversionError, match=r"found pytorch_model.bin: pickle checkpoints are not read"):
        convert(copy, tmp_path / "out")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"causal": False}, r"decoder.0.mixer: `causal` = False cannot be written: the format has only True \(llama"),
        ({"window_size": 8}, r"decoder.0.mixer: `window_size` = 8 cannot be written: the format has only None"),
        ({"query_norm": {"type": "rms_norm"}}, r"`query_norm` = RMSNormalizationConfig"),
        ({"dense": {"bias": {"enabled": True}}}, r"attention biases .* `attention_bias` sets q, k, v and o biases"),
        ({"softmax_scale": 0.5}, r"`softmax_scale` 0.5 cannot be written"),
        ({"rotary": {"type": "none"}}, r"`rotary` type 'none' cannot be written"),
    ],
)
def test_exporting_what_the_format_cannot_express(hf_directory, tmp_path, change, message):
    data = to_dict(blockzoo.load(hf_directory).config)
    data["decoder"]["block"]["mixer"].update(change)
    model = blockzoo.build({"model": data})
    with pytest.raises(ConversionError, match=message):
        blockzoo.save(model, tmp_path / "hf", format="llama")
    assert not (tmp_path / "hf").exists()


def test_exporting_a_layer_type_the_format_does_not_have(hf_directory, tmp_path):
    data = to_dict(blockzoo.load(hf_directory).config)
    data["decoder"]["block"]["mlp"] = {"type": "moe", "experts": 2, "intermediate_size": 8}
    with pytest.raises(ConversionError, match=r"decoder.0.mlp: mlp type 'moe' cannot be written in the llama format"):
        blockzoo.save(blockzoo.build({"model": data}), tmp_path / "hf", format="llama")


def test_exporting_a_normalization_the_format_does_not_have(hf_directory, tmp_path):
    data = to_dict(blockzoo.load(hf_directory).config)
    data["head"]["normalization"] = {"type": "layer_norm"}
    with pytest.raises(ConversionError, match=r"head.normalization: type 'layer_norm' cannot be written"):
        blockzoo.save(blockzoo.build({"model": data}), tmp_path / "hf", format="llama")


def test_an_unknown_format(hf_directory, tmp_path):
    with pytest.raises(ConversionError, match=r"unknown checkpoint format 'lama'; available: blockzoo, .*llama"):
        blockzoo.save(blockzoo.load(hf_directory), tmp_path / "x", format="lama")


def test_two_plugins_registering_one_section(hf_directory):
    @hookimpl
    def register_converters(register):
        register("llama", Section(config_class=AttentionConfig, config=(Rename("heads", "num_attention_heads"),)))

    try:
        register_plugin(types.SimpleNamespace(register_converters=register_converters), "acme")
        with pytest.raises(ConversionError, match=r"registered by both plugin 'attention' .* and plugin 'acme'"):
            blockzoo.load(hf_directory)
    finally:
        reset_registry()


# A block of each format, with a mixture of experts: Mixtral's (softmax) and NemotronH's (sigmoid, a layer of its own).
_MOE_BLOCKS = {
    "mixtral": {
        "mixer": {"type": "attention", "heads": 2, "head_groups": 1, "head_size": 8, "rotary": {"type": "default"}},
        "mlp": {"type": "moe", "experts": 4, "intermediate_size": 8},
    },
    "nemotron_h": {
        "mixer": {"type": "none"},
        "mlp": {
            "type": "moe",
            "experts": 4,
            "intermediate_size": 8,
            "shared_experts": 1,
            "gated": False,
            "routing": "sigmoid_top_k",
            "score_correction_bias": True,
        },
    },
}


@pytest.mark.parametrize(
    ("format_name", "change", "message"),
    [
        ("mixtral", {"routing": "sigmoid_top_k"}, r"routing sigmoid_top_k cannot be written: this format's router"),
        ("mixtral", {"routed_scale": 2.0}, r"`routed_scale` = 2.0 cannot be written: the format has only 1.0"),
        (
            "nemotron_h",
            {"routing": "softmax_top_k", "score_correction_bias": False},
            r"`routing` = 'softmax_top_k' cannot be written",
        ),
        ("nemotron_h", {"shared_experts": 0}, r"shared_experts = 0: NemotronH has shared experts in every MoE layer"),
    ],
)
def test_exporting_a_router_the_format_does_not_have(tmp_path, format_name, change, message):
    block = _MOE_BLOCKS[format_name]
    block = {**block, "mlp": {**block["mlp"], **change}}
    model = blockzoo.build({"model": {"hidden_size": 16, "decoder": {"block": block}}})
    with pytest.raises(ConversionError, match=message):
        blockzoo.save(model, tmp_path / "hf", format=format_name)
    assert not (tmp_path / "hf").exists()
