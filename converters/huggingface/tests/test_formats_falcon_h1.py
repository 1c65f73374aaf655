"""The Falcon-H1 format (falcon_h1) against transformers itself: import, export, both round trips, a transformers 4.x
config, every μP multiplier mapped to its own field (and each one showing in the logits), the Mamba output norm's
variants (none, normalize then gate), and what cannot be converted.

Each case is a tiny random transformers model whose mapped fields are all away from their defaults
(hf_cases_falcon_h1.py); mamba_ssm is not importable here, so transformers runs its Mamba's torch path.
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
    read_tensors,
    saved_transformers_cases,
    with_config,
)
from hf_cases import TOKENS, our_logits
from hf_cases_falcon_h1 import CASES, format_of

import blockzoo
from blockzoo.config import structure, to_dict
from blockzoo.conversion import ConversionError, checkpoint_formats, get_format, sections, unclaimed_fields
from blockzoo.model.config import FixedBlockSequenceConfig, ModelConfig, ParallelBlockConfig
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


@pytest.mark.parametrize("case", CASES)
def test_huggingface_to_blockzoo_to_huggingface_is_identical(case, hf_directories, tmp_path):
    directory, _ = hf_directories[case]
    config = read_config(directory)
    # The export always writes `head_dim` (transformers reads it, else hidden / heads): the same model.
    implied = {"head_dim": config["hidden_size"] // config["num_attention_heads"]}
    check_huggingface_round_trip(directory, "falcon_h1", tmp_path, comparable({**implied, **config}))


@pytest.mark.parametrize("case", CASES)
def test_blockzoo_to_huggingface_to_blockzoo_is_identical(case, hf_directories, tmp_path):
    check_blockzoo_round_trip(hf_directories[case][0], format_of(case), tmp_path)


def test_every_layer_is_a_parallel_block_and_the_multipliers_are_their_own_fields(hf_directories):
    config = blockzoo.load(hf_directories["falcon_h1"][0]).config
    assert config.embeddings.multiplier == 3.0 and config.head.logits_multiplier == 0.25
    assert isinstance(config.decoder, FixedBlockSequenceConfig) and config.decoder.num_blocks == 2
    block = config.decoder.block
    assert isinstance(block, ParallelBlockConfig) and list(block.mixers) == ["attention", "mamba"]
    assert block.input_multipliers == {"attention": 0.8, "mamba": 1.2}
    assert block.output_multipliers == {"attention": 1.3, "mamba": 0.6}
    assert block.residual_multiplier == 1.0
    attention, mamba = block.mixers["attention"], block.mixers["mamba"]
    assert attention.key_multiplier == 0.7 and attention.head_size == 12 and attention.softmax_scale is None
    assert mamba.in_proj_multipliers == {"z": 0.5, "x": 1.5, "b": 0.7, "c": 1.1, "dt": 0.9}
    assert mamba.heads * mamba.head_size == 48 and mamba.groups == 2 and mamba.normalization.per_group
    assert (block.mlp.gate_multiplier, block.mlp.down_multiplier) == (0.8, 1.4)


# Each mapped multiplier set back to 1 in our model (same weights): the case must see every one of them.
UNSCALED = {
    "embedding_multiplier": lambda c: attrs.evolve(c, embeddings=attrs.evolve(c.embeddings, multiplier=1.0)),
    "lm_head_multiplier": lambda c: attrs.evolve(c, head=attrs.evolve(c.head, logits_multiplier=1.0)),
    "attention_in_multiplier": lambda b: attrs.evolve(b, input_multipliers={"mamba": 1.2}),
    "ssm_in_multiplier": lambda b: attrs.evolve(b, input_multipliers={"attention": 0.8}),
    "attention_out_multiplier": lambda b: attrs.evolve(b, output_multipliers={"mamba": 0.6}),
    "ssm_out_multiplier": lambda b: attrs.evolve(b, output_multipliers={"attention": 1.3}),
    "key_multiplier": lambda b: _mixer(b, "attention", key_multiplier=1.0),
    **{
        f"ssm_multipliers[{name}]": lambda b, name=name: _mixer(
            b,
            "mamba",
            in_proj_multipliers={k: v for k, v in b.mixers["mamba"].in_proj_multipliers.items() if k != name},
        )
        for name in ("z", "x", "b", "c", "dt")
    },
    "mlp_multipliers[gate]": lambda b: attrs.evolve(b, mlp=attrs.evolve(b.mlp, gate_multiplier=1.0)),
    "mlp_multipliers[down]": lambda b: attrs.evolve(b, mlp=attrs.evolve(b.mlp, down_multiplier=1.0)),
}


def _mixer(block, name: str, **changes):
    return attrs.evolve(block, mixers={**block.mixers, name: attrs.evolve(block.mixers[name], **changes)})


@pytest.mark.parametrize("multiplier", UNSCALED)
def test_every_multiplier_shows_in_the_logits(multiplier, hf_directories):
    directory, expected = hf_directories["falcon_h1"]
    model = blockzoo.load(directory)
    config = model.config
    if multiplier in ("embedding_multiplier", "lm_head_multiplier"):
        changed = UNSCALED[multiplier](config)
    else:
        block = UNSCALED[multiplier](config.decoder.block)
        changed = attrs.evolve(config, decoder=attrs.evolve(config.decoder, block=block))
    assert changed != config
    unscaled = blockzoo.build({"model": to_dict(changed)})
    unscaled.load_state_dict(model.state_dict())
    assert not torch.allclose(our_logits(unscaled), expected, **TOLERANCE), f"{multiplier} changes nothing"


def test_a_transformers_4_config_imports_the_same_model(hf_directories, tmp_path):
    directory, expected = hf_directories["falcon_h1"]
    config = read_config(directory)
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None
    config["torch_dtype"] = config.pop("dtype")
    config["time_step_limit"] = [0.3, 0.9]
    model = blockzoo.load(with_config(directory, tmp_path / "legacy", config))
    assert model.config == blockzoo.load(directory).config
    torch.testing.assert_close(our_logits(model), expected, **TOLERANCE)


def test_export_for_transformers_4_writes_its_keys(hf_directories, tmp_path):
    model = blockzoo.load(hf_directories["falcon_h1"][0])
    blockzoo.save(model, tmp_path / "hf", format="falcon_h1", transformers_version="4.57.6")
    config = read_config(tmp_path / "hf")
    assert config["rope_theta"] == 3000.0 and "rope_parameters" not in config
    assert blockzoo.load(tmp_path / "hf").config == model.config


def test_every_field_of_every_converted_config_class_is_claimed():
    registered = sections("falcon_h1")
    assert {cls.__name__ for cls in registered} >= {
        "AttentionConfig",
        "Mamba2Config",
        "DenseMLPConfig",
        "ParallelBlockConfig",
        "RMSNormalizationConfig",
    }
    # A parallel block needs a mixer (its fields are claimed whatever it holds).
    minimal = {ParallelBlockConfig: {"mixers": {"attention": {"type": "attention"}}}}
    for config_class, section in registered.items():
        config = structure(minimal.get(config_class, {}), config_class)
        assert unclaimed_fields(section, config) == [], config_class.__name__
    model_section = checkpoint_formats()["falcon_h1"].model_section
    assert unclaimed_fields(model_section, ModelConfig(), claimed=("decoder",)) == []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mamba_d_head": 5}, r"`mamba_n_heads` 6 × `mamba_d_head` 5 is not the inner size 48"),
        ({"ssm_multipliers": [1.0, 2.0]}, r"`ssm_multipliers` must be \[z, x, B, C, dt\]"),
        ({"mlp_multipliers": [1.0]}, r"`mlp_multipliers` must be \[gate, down\]"),
    ],
)
def test_what_falcon_h1_cannot_express_is_refused_on_import(change, message, hf_directories, tmp_path):
    directory, _ = hf_directories["falcon_h1"]
    copy = with_config(directory, tmp_path / "changed", {**read_config(directory), **change})
    with pytest.raises(ConversionError, match=message):
        blockzoo.load(copy)


def test_the_mamba_norm_variants_map_to_their_fields(hf_directories):
    norms = {
        case: blockzoo.load(hf_directories[case][0]).config.decoder.block.mixers["mamba"].normalization
        for case in CASES
    }
    assert (norms["falcon_h1"].enabled, norms["falcon_h1"].norm_before_gate) == (True, False)
    assert (norms["falcon_h1-norm-before-gate"].enabled, norms["falcon_h1-norm-before-gate"].norm_before_gate) == (
        True,
        True,
    )
    assert not norms["falcon_h1-no-mamba-norm"].enabled
    # No norm, no weight: the checkpoint has none and neither has our model.
    directory = hf_directories["falcon_h1-no-mamba-norm"][0]
    assert not any("mamba.norm" in name for name in read_tensors(directory))
    assert not any(
        "normalization" in name for name in blockzoo.load(directory).state_dict() if ".mixers.mamba." in name
    )


@pytest.mark.parametrize("case", ["falcon_h1", "falcon_h1-norm-before-gate"])
def test_the_norm_order_shows_in_the_logits(case, hf_directories):
    # The other order on the same weights gives other logits: the oracle tests see which order is computed.
    directory, expected = hf_directories[case]
    model = blockzoo.load(directory)
    block = model.config.decoder.block
    norm = block.mixers["mamba"].normalization
    flipped = _mixer(block, "mamba", normalization=attrs.evolve(norm, norm_before_gate=not norm.norm_before_gate))
    other = blockzoo.build(
        {"model": to_dict(attrs.evolve(model.config, decoder=attrs.evolve(model.config.decoder, block=flipped)))}
    )
    other.load_state_dict(model.state_dict())
    assert not torch.allclose(our_logits(other), expected, **TOLERANCE)


def test_a_config_without_the_norm_keys_means_no_norm(hf_directories, tmp_path):
    # transformers' defaults: `mamba_rms_norm` false (no norm), `mamba_norm_before_gate` true (read only with a norm).
    directory, expected = hf_directories["falcon_h1-no-mamba-norm"]
    keys = ("mamba_rms_norm", "mamba_norm_before_gate")
    config = {key: value for key, value in read_config(directory).items() if key not in keys}
    model = blockzoo.load(with_config(directory, tmp_path / "default", config))
    assert model.config == blockzoo.load(directory).config
    torch.testing.assert_close(our_logits(model), expected, **TOLERANCE)


def test_without_the_norm_its_epsilon_is_not_written(hf_directories, tmp_path):
    # `rms_norm_eps` is the Mamba norm's and the model's norms': without the Mamba norm only theirs is written.
    directory, expected = hf_directories["falcon_h1-no-mamba-norm"]
    model = blockzoo.load(directory)
    block = model.config.decoder.block
    norm = block.mixers["mamba"].normalization
    changed = _mixer(block, "mamba", normalization=attrs.evolve(norm, epsilon=0.5))
    config = attrs.evolve(model.config, decoder=attrs.evolve(model.config.decoder, block=changed))
    other = blockzoo.build({"model": to_dict(config)})
    other.load_state_dict(model.state_dict())
    blockzoo.save(other, tmp_path / "hf", format="falcon_h1")
    assert read_config(tmp_path / "hf")["rms_norm_eps"] == read_config(directory)["rms_norm_eps"]
    torch.testing.assert_close(our_logits(blockzoo.load(tmp_path / "hf")), expected, **TOLERANCE)


def test_without_the_norm_the_order_is_written_as_transformers_default(hf_directories, tmp_path):
    # mamba_norm_before_gate false without a norm is the same model: it imports alike and is written as true.
    directory, expected = hf_directories["falcon_h1-no-mamba-norm"]
    changed = with_config(directory, tmp_path / "false", {**read_config(directory), "mamba_norm_before_gate": False})
    model = blockzoo.load(changed)
    assert model.config == blockzoo.load(directory).config
    torch.testing.assert_close(our_logits(model), expected, **TOLERANCE)
    blockzoo.save(model, tmp_path / "hf", format="falcon_h1")
    config = read_config(tmp_path / "hf")
    assert (config["mamba_rms_norm"], config["mamba_norm_before_gate"]) == (False, True)


def test_what_falcon_h1_cannot_express_is_refused_on_export(hf_directories, tmp_path):
    directory, _ = hf_directories["falcon_h1"]
    model = to_dict(blockzoo.load(directory).config)
    export = get_format("falcon_h1").export_config
    block = model["decoder"]["block"]
    with pytest.raises(ConversionError, match=r"residual_multiplier` = 0\.5 cannot be written"):
        export(
            structure(
                {**model, "decoder": {**model["decoder"], "block": {**block, "residual_multiplier": 0.5}}}, ModelConfig
            )
        )
    two_attentions = {
        **block,
        "mixers": {"attention": block["mixers"]["attention"], "mamba": block["mixers"]["attention"]},
    }
    with pytest.raises(ConversionError, match="one attention and one mamba_2"):
        export(structure({**model, "decoder": {**model["decoder"], "block": two_attentions}}, ModelConfig))
    decoder_blocks = to_dict(blockzoo.load(directory).config)
    decoder_blocks["decoder"]["block"] = {"type": "decoder"}
    with pytest.raises(ConversionError, match="cannot be written in the falcon_h1 format"):
        export(structure(decoder_blocks, ModelConfig))
    convert(directory, tmp_path / "native")  # a native checkpoint of it converts back (streaming)
    convert(tmp_path / "native", tmp_path / "back", format="falcon_h1")
    assert blockzoo.load(tmp_path / "back").config == blockzoo.load(directory).config


def test_mixers_under_other_names_are_written_by_their_types(hf_directories, tmp_path):
    directory, expected = hf_directories["falcon_h1"]
    model = blockzoo.load(directory)
    data = to_dict(model.config)
    block = data["decoder"]["block"]
    rename = {"attention": "attn", "mamba": "ssm"}
    for field_name in ("mixers", "input_multipliers", "output_multipliers"):
        block[field_name] = {rename[name]: value for name, value in reversed(block[field_name].items())}
    renamed = blockzoo.build({"model": data})
    renamed.load_state_dict(
        {
            name.replace("mixers.attention.", "mixers.attn.").replace("mixers.mamba.", "mixers.ssm."): value
            for name, value in model.state_dict().items()
        }
    )
    blockzoo.save(renamed, tmp_path / "hf", format="falcon_h1")
    from hf_cases import hf_logits, load_hf

    torch.testing.assert_close(hf_logits(load_hf(tmp_path / "hf")), expected, **TOLERANCE)


def _tensor_parallel_ranks(hf_dir: str, expected_path: str, out_dir: str) -> None:
    from safetensors.torch import load_file

    from blockzoo.api import Distributed, DistributedConfig

    with Distributed(DistributedConfig(tensor_parallel=2, backend="gloo")) as distributed:
        model = blockzoo.load(hf_dir, distributed=distributed)
        in_proj = dict(model.named_parameters())["decoder.0.mixers.mamba.in_proj.weight"]
        assert in_proj.shape[0] * 2 == in_proj.meta.global_shape[0]  # each rank its heads and groups
        torch.testing.assert_close(our_logits(model), load_file(expected_path)["logits"], **TOLERANCE)
        blockzoo.save(model, out_dir, format="falcon_h1")


@pytest.mark.distributed
def test_tensor_parallel_load_and_save(hf_directories, tmp_path):
    # The in_proj multipliers apply to each rank's share of z, x, B, C, dt; saving gathers the very tensors.
    from safetensors.torch import save_file

    from blockzoo_testing.distributed import run_distributed

    directory, expected = hf_directories["falcon_h1"]
    save_file({"logits": expected}, tmp_path / "expected.safetensors")
    run_distributed(
        2, _tensor_parallel_ranks, str(directory), str(tmp_path / "expected.safetensors"), str(tmp_path / "out")
    )
    original, saved = read_tensors(directory), read_tensors(tmp_path / "out")
    assert saved.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(saved[name], tensor), name


@pytest.mark.parametrize("case", ["falcon_h1", "falcon_h1-no-mamba-norm", "falcon_h1-norm-before-gate"])
def test_greedy_generation_is_transformers(case, hf_directories):
    # Both sides step one token at a time through their caches: attention's keys (times key_multiplier) and Mamba 2's
    # convolution and SSM states, with every multiplier applied at each step (and each output-norm variant: without
    # the norm transformers' step gates y by z inside its state update).
    from hf_cases import load_hf

    directory, _ = hf_directories[case]
    prompt = TOKENS[0, :9]
    with torch.no_grad():
        expected = load_hf(directory).generate(
            prompt[None], max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :]
    (ours,) = blockzoo.load(directory).eval().generate([prompt.tolist()], max_new_tokens=8)
    assert ours == expected.tolist()
