"""The attention config: defaults, errors that name the field, registration, and a torch-free config module."""

import pytest

from blockzoo import config as configs
from blockzoo.api import MixerConfig
from blockzoo.plugins import get_registry
from blockzoo_attention.config import AttentionConfig, DefaultRotaryConfig
from blockzoo_testing import check_config_error, check_imports_no_torch, check_registered

# What the mixer declares: every kind of parallelism and a generation cache.
CAPABILITIES = {"tensor_parallel", "sequence_tensor_parallel", "sequence_data_parallel", "generation_cache"}


def structure(data: dict) -> AttentionConfig:
    return configs.structure(data, AttentionConfig)


def test_defaults():
    config = structure({})
    assert config == AttentionConfig()
    assert (config.heads, config.resolved_head_groups, config.head_size) == (8, 8, 64)
    assert config.rotary == DefaultRotaryConfig(theta=10000.0)
    assert config.causal and config.window_size is None and config.resolved_softmax_scale == 64**-0.5
    assert not any(config.has_bias(linear) for linear in (config.query, config.key, config.value, config.dense))
    assert structure({"softmax_scale": 0.25}).resolved_softmax_scale == 0.25


def test_attention_is_the_default_mixer():
    assert isinstance(configs.structure({}, MixerConfig), AttentionConfig)
    assert isinstance(configs.structure({"type": "attention", "heads": 2}, MixerConfig), AttentionConfig)


def test_add_linear_biases_sets_each_default():
    config = structure({"add_linear_biases": True, "dense": {"bias": {"enabled": False}}})
    assert [config.has_bias(linear) for linear in (config.query, config.key, config.value, config.dense)] == [
        True,
        True,
        True,
        False,
    ]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"heads": 0}, "heads: must be >= 1, got 0"),
        ({"heads": 6, "head_groups": 4}, r"head_groups: must divide heads \(6\), got 4"),
        ({"heads": 2, "head_groups": 4}, r"head_groups: must be <= heads \(2\), got 4"),
        ({"head_groups": 0}, "head_groups: must be >= 1, got 0"),
        ({"window_size": 0}, "window_size: must be >= 1, got 0"),
        ({"causal": False, "window_size": 4}, "window_size: a sliding window needs causal attention"),
        ({"head_size": 7}, "head_size: rotary embeddings rotate pairs of dims: head_size must be even, got 7"),
        ({"softmax_scale": 0.0}, "softmax_scale: must be > 0"),
        ({"key": {"bias": {"enabled": True}}}, "value.bias.enabled: key and value are one fused key_value weight"),
        ({"implementation": "flash"}, "implementation: expected one of 'auto', 'torch', 'varlen', 'batched', 'flex'"),
        ({"rotary": {"type": "yarn", "scale_factor": -1}}, "rotary.scale_factor: must be > 0"),
        ({"query_norm": {"type": "batch_norm"}}, "query_norm.type: unknown normalization type 'batch_norm'"),
        ({"heads_count": 4}, "heads_count: unknown key"),
    ],
)
def test_errors_name_the_field(data, message):
    check_config_error(AttentionConfig, data, message)


def test_odd_head_size_is_fine_without_rotary():
    assert structure({"head_size": 7, "rotary": {"type": "none"}}).head_size == 7


def test_registration_and_capabilities():
    check_registered("mixer", "attention", AttentionConfig, "Attention", CAPABILITIES)
    assert set(get_registry().available("rotary")) >= {"none", "default", "llama3", "yarn"}


def test_config_module_imports_no_torch():
    check_imports_no_torch("blockzoo_attention.config", "blockzoo_attention.plugin")
