"""Every preset written as a Hugging Face config.json, checked against transformers (all on the meta device but the
round trips, which run tiny copies on the CPU):

- the model blockzoo builds has exactly the parameters transformers builds from the same config.json, and the count
  the preset states (and, for a MoE, the active count: everything but the routed experts a token does not use);
- the preset's blockzoo config exported to its format (config only) is accepted by transformers, which builds a model
  of that same count;
- a tiny copy of the preset (the same structure, small widths: `TINY`) round-trips weights through its format: a
  random transformers model imported gives transformers' logits, and a random blockzoo model exported gives ours.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from format_checks import check_export, check_import
from hf_cases import hf_logits, randomize

import blockzoo.presets
from blockzoo.config import structure
from blockzoo.conversion import get_format
from blockzoo.preflight import model_on_meta_device
from blockzoo.run_config import RunConfig

HF_PRESETS = [name for name in blockzoo.presets.names() if blockzoo.presets.get(name).format_config is not None]
MOE_PRESETS = [name for name in HF_PRESETS if blockzoo.presets.get(name).active_parameters is not None]

_SMALL = {"hidden_size": 64, "vocab_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
_SMALL_MAMBA = {"mamba_d_state": 16, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_chunk_size": 16}
# Per format: the widths a tiny copy takes; the layer structure (layer kinds and their order, routing, tying, rotary
# variant, biases, norms) stays the preset's.
TINY = {
    "llama": {**_SMALL, "intermediate_size": 96, "num_hidden_layers": 2},
    "mistral": {**_SMALL, "intermediate_size": 96, "num_hidden_layers": 2, "sliding_window": 8},
    "qwen3": {**_SMALL, "intermediate_size": 96, "num_hidden_layers": 2},
    "mixtral": {**_SMALL, "intermediate_size": 32, "num_hidden_layers": 2, "num_local_experts": 4},
    "qwen3_moe": {
        **_SMALL,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_experts": 8,
        "num_experts_per_tok": 2,
    },
    "deepseek_v3": {
        **_SMALL,
        "num_key_value_heads": 4,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "n_routed_experts": 8,
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 2,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
    },
    "mamba2": {
        "hidden_size": 64,
        "vocab_size": 128,
        "num_heads": 8,
        "head_dim": 16,
        "state_size": 16,
        "chunk_size": 16,
        "num_hidden_layers": 2,
    },
    "falcon_h1": {
        **_SMALL,
        **_SMALL_MAMBA,
        "intermediate_size": 96,
        "mamba_d_ssm": 128,
        "num_hidden_layers": 2,
    },
    "nemotron_h": {
        **_SMALL,
        "intermediate_size": 96,
        "hybrid_override_pattern": "M-M*-",
        "num_hidden_layers": 5,
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "n_groups": 2,
        "ssm_state_size": 16,
        "chunk_size": 16,
    },
    "granitemoehybrid": {
        **_SMALL,
        **_SMALL_MAMBA,
        "intermediate_size": 32,
        "shared_intermediate_size": 48,
        "layer_types": ["mamba", "attention", "mamba"],
        "num_hidden_layers": 3,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    "qwen3_next": {
        **_SMALL,
        "num_hidden_layers": 4,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    },
}


def our_count(config: dict | str) -> int:
    """Parameters of the model blockzoo builds (one process, meta device)."""
    model = {"preset": config} if isinstance(config, str) else config
    run_config = structure({"model": model}, RunConfig)
    return sum(parameter.numel() for parameter in model_on_meta_device(run_config).parameters())


def transformers_meta_model(config_json: dict, directory: Path | None = None) -> transformers.PreTrainedModel:
    """transformers' model of a config.json (given as data; or, with `directory`, written there and read back as
    transformers reads a checkpoint's, JSON-tagged infinities and all)."""
    if directory is None:
        config = transformers.AutoConfig.for_model(**config_json)
    else:
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(config_json))
        config = transformers.AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def transformers_count(model: transformers.PreTrainedModel) -> int:
    """Its parameters, and DeepSeek-V3's router score-correction bias (a buffer there, a parameter here: trained)."""
    buffers = sum(b.numel() for name, b in model.named_buffers() if name.endswith("e_score_correction_bias"))
    return sum(parameter.numel() for parameter in model.parameters()) + buffers


def transformers_active_count(model: transformers.PreTrainedModel) -> int:
    """Its parameters less the routed experts a token does not use: each `experts` module holds its experts' weights
    stacked on the first dimension, of which a token uses `num_experts_per_tok`."""
    per_token = model.config.num_experts_per_tok
    unused = 0
    for name, module in model.named_modules():
        if name.endswith(".experts"):
            weights = list(module.parameters())
            experts = weights[0].shape[0]
            unused += sum(weight.numel() for weight in weights) * (experts - per_token) // experts
    return transformers_count(model) - unused


@pytest.mark.parametrize("name", HF_PRESETS)
def test_the_parameter_count_is_the_count_transformers_builds_from_the_published_config(name):
    preset = blockzoo.presets.get(name)
    theirs = transformers_count(transformers_meta_model(dict(preset.format_config)))
    assert our_count(name) == theirs == preset.parameters


@pytest.mark.parametrize("name", MOE_PRESETS)
def test_the_active_parameter_count_leaves_out_the_experts_a_token_does_not_use(name):
    preset = blockzoo.presets.get(name)
    model = transformers_meta_model(dict(preset.format_config))
    assert transformers_active_count(model) == preset.active_parameters < preset.parameters


@pytest.mark.parametrize("name", HF_PRESETS)
def test_the_preset_exported_to_its_format_is_accepted_by_transformers_with_the_same_count(name, tmp_path):
    preset = blockzoo.presets.get(name)
    exported = get_format(preset.format).export_config(blockzoo.presets.model_config(name))
    assert exported["model_type"] == preset.format_config["model_type"]
    assert transformers_count(transformers_meta_model(exported, tmp_path / "exported")) == preset.parameters


@pytest.mark.parametrize("name", HF_PRESETS)
def test_a_tiny_copy_round_trips_weights_through_its_format(name, tmp_path):
    preset = blockzoo.presets.get(name)
    # head_dim only where the preset gives one (DeepSeek's and Granite's heads have their own sizes).
    widths = {
        key: value for key, value in TINY[preset.format].items() if key != "head_dim" or key in preset.format_config
    }
    tiny = {**preset.format_config, **widths}
    config = transformers.AutoConfig.for_model(**tiny)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    randomize(model, seed=0)
    model.eval().save_pretrained(tmp_path / "hf")
    check_import(tmp_path / "hf", hf_logits(model))  # their weights, our logits = theirs
    check_export(tmp_path / "hf", preset.format, tmp_path / "export")  # our weights, their logits = ours


def test_every_format_of_a_preset_has_a_tiny_copy():
    assert {blockzoo.presets.get(name).format for name in HF_PRESETS} <= TINY.keys()
