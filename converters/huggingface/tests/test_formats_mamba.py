"""The Mamba 1 formats. `mamba` and `jamba` against transformers itself: import, export, both round trips.
`apriel_hybrid_ssm` (remote, CUDA-only code) against a float64 implementation of their modelling code's maths
(apriel_reference.py, itself checked against transformers' Mistral on attention layers) and by both round trips.
What a format or blockzoo cannot express is refused, naming it. Cases: mamba_cases.py (every mapped field away
from its default, batch 2 × 37 tokens)."""

from __future__ import annotations

import apriel_reference
import pytest
import torch
import transformers
from format_checks import (
    TOLERANCE,
    check_blockzoo_round_trip,
    check_export,
    check_huggingface_round_trip,
    check_import,
    comparable,
    random_model,
    read_config,
    read_tensors,
    saved_transformers_cases,
)
from hf_cases import TOKENS, hf_logits, load_hf, our_logits
from mamba_cases import APRIEL_CASES, CASES, save_apriel

import blockzoo
from blockzoo.config import structure
from blockzoo.conversion import ConversionError, checkpoint_formats
from blockzoo.model.config import ModelConfig

ROUND_TRIPS = [*CASES, "apriel", "apriel_implicit_sizes"]


def _format(case: str) -> str:
    return CASES[case][0] if case in CASES else "apriel_hybrid_ssm"


@pytest.fixture(scope="module")
def directories(tmp_path_factory):
    """case -> (a checkpoint directory of the case, the logits of its own model: transformers', or the float64
    reference's for Apriel)."""
    found = saved_transformers_cases(tmp_path_factory, CASES)
    for case in APRIEL_CASES:
        directory = tmp_path_factory.mktemp(case)
        tensors = save_apriel(case, directory)
        found[case] = (directory, apriel_reference.logits(APRIEL_CASES[case], tensors, TOKENS))
    return found


def _as_written(config: dict) -> dict:
    """The original config in the form the export writes the same model: sizes made explicit."""
    config = dict(config)
    if config["model_type"] == "jamba":
        config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    if "ssm_cfg" in config:  # Apriel: d_inner and d_xb written explicitly (then `expand` is not read)
        ssm = dict(config["ssm_cfg"])
        if ssm["d_inner"] is None:
            ssm.update(d_inner=ssm["expand"] * config["hidden_size"], expand=1)
        ssm["d_xb"] = ssm["d_xb"] or config["hidden_size"]
        config["ssm_cfg"] = ssm
    return config


@pytest.mark.parametrize("case", CASES)
def test_import_gives_the_logits_of_transformers(case, directories):
    check_import(*directories[case])


@pytest.mark.parametrize("case", CASES)
def test_export_loads_in_transformers_with_our_logits(case, directories, tmp_path):
    check_export(directories[case][0], _format(case), tmp_path)


@pytest.mark.parametrize("case", ROUND_TRIPS)
def test_huggingface_to_blockzoo_to_huggingface_is_identical(case, directories, tmp_path):
    directory, _ = directories[case]
    expected_config = _as_written(comparable(read_config(directory)))
    check_huggingface_round_trip(directory, _format(case), tmp_path, expected_config)


@pytest.mark.parametrize("case", ROUND_TRIPS)
def test_blockzoo_to_huggingface_to_blockzoo_is_identical(case, directories, tmp_path):
    check_blockzoo_round_trip(directories[case][0], _format(case), tmp_path)


# ---------------------------------------------------------------------------------------------------------------------
# Apriel hybrid SSM


def test_the_apriel_reference_is_transformers_mistral_on_attention_layers(directories):
    # Their "t" layers are Mistral's decoder layers, their model Mistral's around them: same tensors, same logits.
    directory, reference = directories["apriel_attention_only"]
    config = {
        key: value
        for key, value in read_config(directory).items()
        if key not in ("hybrid_block_layout", "ssm_cfg", "auto_map", "architectures", "model_type", "torch_dtype")
    }
    mistral = transformers.MistralForCausalLM(transformers.MistralConfig(**config)).eval()
    mistral.load_state_dict(read_tensors(directory), strict=True)
    torch.testing.assert_close(hf_logits(mistral).double(), reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", APRIEL_CASES)
def test_apriel_import_gives_the_logits_of_their_layers(case, directories):
    directory, expected = directories[case]
    torch.testing.assert_close(our_logits(blockzoo.load(directory)).double(), expected, **TOLERANCE)


def test_apriel_dt_bias_is_twice_their_dt_proj_bias(directories):
    # Their Mamba adds dt_proj.bias inside dt_proj and again as the scan's delta_bias.
    directory, _ = directories["apriel"]
    parameters = dict(blockzoo.load(directory).named_parameters())
    tensors = read_tensors(directory)
    for layer in (1, 4):
        expected = 2 * tensors[f"model.layers.{layer}.mixer.dt_proj.bias"]
        assert torch.equal(parameters[f"decoder.{layer}.mixer.dt_bias"], expected)


def test_apriel_is_written_in_the_transformers_4_form_of_their_code(directories, tmp_path):
    model = blockzoo.load(directories["apriel"][0])
    blockzoo.save(model, tmp_path / "pinned", format="apriel_hybrid_ssm")
    config = read_config(tmp_path / "pinned")
    assert config["rope_theta"] == 20000.0 and "rope_parameters" not in config
    assert config["transformers_version"] == "4.53.2" and config["torch_dtype"] == "float32"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_apriel_hybrid_ssm.AprielHybridSSMForCausalLM"
    blockzoo.save(model, tmp_path / "v5", format="apriel_hybrid_ssm", transformers_version="5.0")
    assert read_config(tmp_path / "v5")["rope_parameters"] == {"rope_type": "default", "rope_theta": 20000.0}
    assert blockzoo.load(tmp_path / "v5").config == model.config


# ---------------------------------------------------------------------------------------------------------------------
# What the formats take for granted, and what they refuse


def test_a_mamba_config_without_tie_word_embeddings_is_tied():
    config = {"model_type": "mamba", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2}
    data = checkpoint_formats()["mamba"].import_config(config)
    assert data["tied_embedding_weight"] is True
    mixer = data["decoder"]["block"]["mixer"]
    assert (mixer["state_size"], mixer["expand"], mixer["dt_rank"]) == (16, 2, None)  # transformers' defaults


def _model(*blocks: tuple[dict, dict]) -> ModelConfig:
    """A model of these (mixer, MLP) blocks, in layer order."""
    return structure(
        {
            "hidden_size": 64,
            "embeddings": {"vocab_size": 128},
            "decoder": {
                "type": "pattern",
                "blocks": {str(index): {"mixer": mixer, "mlp": mlp} for index, (mixer, mlp) in enumerate(blocks)},
                "pattern": [str(index) for index in range(len(blocks))],
            },
        },
        ModelConfig,
    )


_NONE = {"type": "none"}
_MLP = {"type": "mlp", "intermediate_size": 96, "gated": True}
_MAMBA = {"type": "mamba", "state_size": 8, "expand": 2}
_JAMBA_MAMBA = {**_MAMBA, **{norm: {"type": "rms_norm", "epsilon": 1e-5} for norm in ("dt_norm", "b_norm", "c_norm")}}
_ATTENTION = {"type": "attention", "heads": 4, "head_size": 16, "rotary": {"type": "none"}}
_GROUPED = {"type": "mamba", "state_size": 8, "inner_size": 128, "xb_size": 32}
_DM2 = {"type": "discrete_mamba_2", "heads": 8, "head_size": 8, "state_size": 8}

# case -> (format, model, the error's words)
REFUSED = {
    "mamba_inner_size": ("mamba", _model(({**_GROUPED, "xb_size": None}, _NONE)), r"`inner_size` = 128 .*expand"),
    "mamba_with_mlp": ("mamba", _model((_MAMBA, _MLP)), r"decoder.0.mlp: mlp type 'mlp' cannot be written"),
    "mamba_grouped": ("mamba", _model(({**_MAMBA, "xb_size": 32}, _NONE)), r"`xb_size` = 32 cannot be written"),
    "mamba_dt_norm": ("mamba", _model((_JAMBA_MAMBA, _NONE)), r"`dt_norm` = .* cannot be written"),
    "jamba_not_periodic": (
        "jamba",
        _model((_ATTENTION, _MLP), (_JAMBA_MAMBA, _MLP), (_ATTENTION, _MLP), (_ATTENTION, _MLP)),
        r"attention layers \[0, 2, 3\] are not every k-th layer.*attn_layer_period",
    ),
    "jamba_one_expert": (
        "jamba",
        _model(
            (
                _ATTENTION,
                {"type": "moe", "experts": 1, "experts_per_token": 1, "intermediate_size": 32, "norm_topk_prob": False},
            )
        ),
        r"a MoE of 1 expert cannot be written",
    ),
    "jamba_without_dt_norm": ("jamba", _model((_MAMBA, _MLP)), r"dt_norm: type 'None' cannot be written"),
    "jamba_gelu": (
        "jamba",
        _model((_JAMBA_MAMBA, {**_MLP, "activation": "gelu"})),
        r"`hidden_act` would be 'silu' .* but 'gelu'",
    ),
    "jamba_rotary": (
        "jamba",
        _model(({**_ATTENTION, "rotary": {"type": "default"}}, _MLP)),
        r"`rotary` cannot be written: this format's attention has no rotary",
    ),
    "jamba_renormalized_moe": (
        "jamba",
        _model((_ATTENTION, {"type": "moe", "experts": 4, "intermediate_size": 32, "routing": "top_k_softmax"})),
        r"renormalized routing cannot be written",
    ),
    "apriel_standard_mamba": (
        "apriel_hybrid_ssm",
        _model((_MAMBA, _MLP)),
        r"`xb_size` = None cannot be written: Apriel's m2 layers have the grouped layout",
    ),
    "apriel_mamba_without_mlp": (
        "apriel_hybrid_ssm",
        _model((_GROUPED, _NONE)),
        r"a block of mixer 'mamba' and MLP 'none' cannot be written in the apriel_hybrid_ssm format",
    ),
    "apriel_two_inner_sizes": (
        "apriel_hybrid_ssm",
        _model((_GROUPED, _MLP), (_DM2, _MLP)),
        r"decoder.0 and decoder.1 need different `ssm_cfg.d_inner` \(128 and 64\)",
    ),
    "apriel_without_dt_bias": (
        "apriel_hybrid_ssm",
        _model(({**_GROUPED, "dt_bias": {"enabled": False}}, _MLP)),
        r"`dt_bias.enabled` = False cannot be written",
    ),
}


def test_a_jamba_without_moe_layers_loads_in_transformers(tmp_path):
    # No MoE: one expert, and a period past the last layer.
    model = random_model(_model((_JAMBA_MAMBA, _MLP), (_ATTENTION, _MLP)), seed=5)
    blockzoo.save(model, tmp_path / "hf", format="jamba")
    written = read_config(tmp_path / "hf")
    assert (written["expert_layer_period"], written["expert_layer_offset"], written["num_experts"]) == (3, 2, 1)
    assert (written["attn_layer_period"], written["attn_layer_offset"]) == (2, 1)
    torch.testing.assert_close(hf_logits(load_hf(tmp_path / "hf")), our_logits(model), **TOLERANCE)
    torch.testing.assert_close(our_logits(blockzoo.load(tmp_path / "hf")), our_logits(model), atol=0, rtol=0)


@pytest.mark.parametrize("case", REFUSED)
def test_what_a_format_cannot_express_is_refused_with_its_name(case):
    format_name, model, message = REFUSED[case]
    with pytest.raises(ConversionError, match=message):
        checkpoint_formats()[format_name].export_config(model)


_SSM_CFG = APRIEL_CASES["apriel"]["ssm_cfg"]
# case -> (format, changes to the case's config.json, the error's words)
IMPORT_REFUSED = {
    "jamba_gelu": ("jamba", {"hidden_act": "gelu"}, r"decoder.0.mixer: `hidden_act` = 'gelu' is not supported"),
    "jamba_offset": ("jamba", {"attn_layer_offset": 3}, r"`attn_layer_offset` = 3 must be in \[0, `attn_layer_period`"),
    "mamba_gelu": ("mamba", {"hidden_act": "gelu"}, r"`hidden_act` = 'gelu' is not supported \(only 'silu'\)"),
    "apriel_gdn": ("apriel_hybrid_ssm", {"hybrid_block_layout": ["t", "gdn"], "num_hidden_layers": 2}, r"\['gdn'\]"),
    "apriel_short_layout": ("apriel_hybrid_ssm", {"hybrid_block_layout": ["t"]}, r"lists 1 layers but `num_hidden_"),
    "apriel_ssm_key": ("apriel_hybrid_ssm", {"ssm_cfg": {"ngroups": 2}}, r"`ssm_cfg` keys \['ngroups'\] are not"),
    "apriel_no_dt_bias": ("apriel_hybrid_ssm", {"ssm_cfg": {**_SSM_CFG, "dt_proj_bias": False}}, "dt_proj_bias"),
    "apriel_gelu": ("apriel_hybrid_ssm", {"ssm_cfg": {**_SSM_CFG, "activation": "gelu"}}, r"'gelu' is not sup"),
}


@pytest.mark.parametrize("case", IMPORT_REFUSED)
def test_a_config_blockzoo_cannot_express_is_refused_with_its_name(case):
    format_name, changes, message = IMPORT_REFUSED[case]
    if format_name == "apriel_hybrid_ssm":
        config = APRIEL_CASES["apriel"]
    else:
        config = {"model_type": format_name, **CASES[format_name][2]}
    with pytest.raises(ConversionError, match=message):
        checkpoint_formats()[format_name].import_config({**config, **changes})
