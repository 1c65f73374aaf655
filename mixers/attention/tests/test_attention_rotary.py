"""Rotary embeddings: frequencies against an independent float64 implementation and (when installed, as in the
test extra) transformers' ROPE_INIT_FUNCTIONS; the rotate-half rotation; every rotary field matters."""

import attrs
import pytest
import torch
from attention_reference import rotary_frequencies, rotate

from blockzoo import config as configs
from blockzoo.layers.base import Batch
from blockzoo_attention.config import (
    DefaultRotaryConfig,
    Llama3RotaryConfig,
    NoRotaryConfig,
    RotaryConfig,
    YarnRotaryConfig,
)
from blockzoo_attention.rotary import apply_rotary, frequencies, rotary_constants, rotary_tables

HEAD_SIZE = 64
ROTARY_CASES = [
    DefaultRotaryConfig(theta=10000.0),
    Llama3RotaryConfig(theta=500000.0),
    Llama3RotaryConfig(
        theta=10000.0,
        scale_factor=4.0,
        low_frequency_factor=2.0,
        high_frequency_factor=8.0,
        original_context_length=4096,
    ),
    YarnRotaryConfig(),
    YarnRotaryConfig(theta=500000.0, scale_factor=16.0, beta_fast=16.0, beta_slow=2.0, original_context_length=4096),
    YarnRotaryConfig(scale_factor=4.0, attention_factor=1.5),
]


@pytest.mark.parametrize("config", ROTARY_CASES, ids=repr)
def test_frequencies_match_an_independent_float64_implementation(config):
    inverse_frequencies, factor = frequencies(config, HEAD_SIZE)
    expected, expected_factor = rotary_frequencies(config, HEAD_SIZE)
    assert inverse_frequencies.dtype == torch.float64
    torch.testing.assert_close(inverse_frequencies, expected, rtol=1e-12, atol=0)
    assert factor == pytest.approx(expected_factor, rel=1e-12)


def _transformers_rope(config: RotaryConfig) -> tuple[torch.Tensor, float]:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if isinstance(config, Llama3RotaryConfig):
        parameters = {
            "rope_type": "llama3",
            "factor": config.scale_factor,
            "low_freq_factor": config.low_frequency_factor,
            "high_freq_factor": config.high_frequency_factor,
            "original_max_position_embeddings": config.original_context_length,
        }
    else:
        parameters = {
            "rope_type": "yarn",
            "factor": config.scale_factor,
            "beta_fast": config.beta_fast,
            "beta_slow": config.beta_slow,
            "original_max_position_embeddings": config.original_context_length,
        }
        if config.attention_factor is not None:
            parameters["attention_factor"] = config.attention_factor
    hf_config = transformers.LlamaConfig(
        hidden_size=2 * HEAD_SIZE,
        num_attention_heads=2,
        head_dim=HEAD_SIZE,
        max_position_embeddings=int(config.original_context_length * config.scale_factor),
        rope_parameters={"rope_theta": config.theta, **parameters},
    )
    return ROPE_INIT_FUNCTIONS[parameters["rope_type"]](hf_config, "cpu")


@pytest.mark.parametrize("config", [c for c in ROTARY_CASES if type(c) is not DefaultRotaryConfig], ids=repr)
def test_frequencies_match_transformers(config):
    expected, expected_factor = _transformers_rope(config)
    inverse_frequencies, factor = frequencies(config, HEAD_SIZE)
    # transformers computes in float32.
    torch.testing.assert_close(inverse_frequencies.float(), expected, rtol=2e-6, atol=0)
    assert factor == pytest.approx(expected_factor, rel=1e-12)


@pytest.mark.parametrize("config", ROTARY_CASES[:4], ids=repr)
def test_rotation_is_rotate_half_over_pairs(config):
    head_size = 16
    lengths = [3, 1000]  # Long enough for large angles.
    batch = Batch(lengths)
    generator = torch.Generator().manual_seed(1)
    heads = torch.randn(batch.num_tokens, 2, head_size, generator=generator)
    rotated = apply_rotary(heads, rotary_tables(rotary_constants(config, head_size), batch))
    for token in [0, 2, 3, 4, 500, 1002]:
        position = int(batch.positions[token])
        for head in range(2):
            expected = rotate(heads[token, head].double(), position, config, head_size)
            torch.testing.assert_close(rotated[token, head].double(), expected, atol=2e-5, rtol=1e-5)


def test_no_rotary_has_no_tables():
    assert rotary_constants(NoRotaryConfig(), 8) is None and rotary_tables(None, Batch([3])) is None


def _variants(config: RotaryConfig) -> dict[str, RotaryConfig]:
    """One changed value per field."""
    changes = {
        "theta": 1234.0,
        "scale_factor": 3.0,
        "low_frequency_factor": 0.5,
        "high_frequency_factor": 6.0,
        "original_context_length": 2048,
        "attention_factor": 2.0,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
    }
    return {
        field.name: attrs.evolve(config, **{field.name: changes[field.name]}) for field in attrs.fields(type(config))
    }


@pytest.mark.parametrize("config", [DefaultRotaryConfig(), Llama3RotaryConfig(), YarnRotaryConfig()], ids=repr)
def test_every_rotary_field_changes_the_frequencies(config):
    base, base_factor = frequencies(config, HEAD_SIZE)
    for name, variant in _variants(config).items():
        changed, factor = frequencies(variant, HEAD_SIZE)
        assert factor != base_factor or not torch.equal(changed, base), f"{type(config).__name__}.{name}"


def test_rotary_types_structure_through_the_registry():
    assert isinstance(configs.structure({}, RotaryConfig), DefaultRotaryConfig)
    assert isinstance(configs.structure({"type": "llama3"}, RotaryConfig), Llama3RotaryConfig)
    yarn = configs.structure({"type": "yarn", "scale_factor": 4}, RotaryConfig)
    assert yarn.resolved_attention_factor == pytest.approx(0.1 * torch.tensor(4.0).log().item() + 1)
    with pytest.raises(configs.ConfigError, match="unknown rotary type 'rope'"):
        configs.structure({"type": "rope"}, RotaryConfig)
    with pytest.raises(configs.ConfigError, match="high_frequency_factor: must be > low_frequency_factor"):
        configs.structure({"type": "llama3", "low_frequency_factor": 4, "high_frequency_factor": 2}, RotaryConfig)
    with pytest.raises(configs.ConfigError, match=r"beta_fast: must be > beta_slow \(8.0\), got 4.0"):
        configs.structure({"type": "yarn", "beta_fast": 4, "beta_slow": 8}, RotaryConfig)
    with pytest.raises(configs.ConfigError, match="theta: must be > 0"):
        configs.structure({"theta": 0}, RotaryConfig)
