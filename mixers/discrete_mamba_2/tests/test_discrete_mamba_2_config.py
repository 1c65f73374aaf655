"""The discrete Mamba 2 config: defaults, errors that name the field, registration, a run config refused for a
tensor-parallel size the mixer cannot split, and a torch-free config module."""

import pytest

from blockzoo import config as configs
from blockzoo.api import ConfigError, MixerConfig
from blockzoo.run_config import RunConfig
from blockzoo_discrete_mamba_2 import plugin
from blockzoo_discrete_mamba_2.config import DiscreteMamba2Config
from blockzoo_testing import check_config_error, check_imports_no_torch, check_registered

# What the mixer declares: every kind of parallelism and a generation cache.
CAPABILITIES = {"tensor_parallel", "sequence_tensor_parallel", "sequence_data_parallel", "generation_cache"}


def structure(data: dict) -> DiscreteMamba2Config:
    return configs.structure(data, DiscreteMamba2Config)


def test_defaults_follow_the_reference():
    config = structure({})
    assert config == DiscreteMamba2Config()
    # phi-mamba's Mixer: d_state 64, n_qk_heads = n_v_heads = 32, d_conv 4, identity, no bias, conv bias, chunk 128.
    assert (config.heads, config.resolved_groups, config.head_size, config.state_size) == (32, 32, 64, 64)
    assert (config.convolution.kernel_size, config.convolution.has_bias, config.activation) == (4, True, "identity")
    assert config.chunk_size == 128 and config.inner_size == 2048 and not config.in_proj_has_bias
    assert structure({"heads": 8, "groups": 2}).resolved_groups == 2


def test_add_linear_biases_sets_each_projection_default():
    config = structure({"add_linear_biases": True, "out_proj": {"bias": {"enabled": False}}})
    assert config.in_proj_has_bias and not config.has_bias(config.out_proj)
    assert not structure({"add_linear_biases": True, "convolution": {"bias": {"enabled": False}}}).convolution.has_bias


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"heads": 0}, "heads: must be >= 1, got 0"),
        ({"heads": 6, "groups": 4}, r"groups: must divide heads \(6\), got 4"),
        ({"heads": 2, "groups": 4}, r"groups: must be <= heads \(2\), got 4"),
        ({"head_size": 0}, "head_size: must be >= 1, got 0"),
        ({"state_size": 0}, "state_size: must be >= 1, got 0"),
        ({"chunk_size": 0}, "chunk_size: must be >= 1, got 0"),
        ({"convolution": {"kernel_size": 0}}, "convolution.kernel_size: must be >= 1, got 0"),
        ({"activation": "gelu"}, "activation: expected one of 'identity', 'silu'"),
        (
            {"dt": {"bias": {"enabled": True}}},
            r"dt.bias.enabled: x, b, c, z and dt are one fused in_proj weight: all have a bias or none "
            r"\(x: False, b: False, c: False, z: False, dt: True\)",
        ),
        ({"d": {"lr_scale": -1}}, r"d.lr_scale: must be >= 0"),
        ({"n_qk_heads": 4}, "n_qk_heads: unknown key"),
    ],
)
def test_errors_name_the_field(data, message):
    check_config_error(DiscreteMamba2Config, data, message)


def test_run_config_refuses_a_tensor_parallel_size_that_does_not_divide_groups():
    model = {
        "decoder": {
            "type": "pattern",
            "pattern": ["ssm"],
            "blocks": {
                "ssm": {"mixer": {"type": "discrete_mamba_2", "heads": 8, "groups": 2}, "mlp": {"type": "none"}}
            },
        }
    }
    ok = configs.structure({"model": model, "distributed": {"tensor_parallel": 2}}, RunConfig)
    assert ok.distributed.tensor_parallel == 2
    with pytest.raises(ConfigError) as error:
        configs.structure({"model": model, "distributed": {"tensor_parallel": 4}}, RunConfig)
    assert (
        "model.decoder.blocks.ssm.mixer.groups: tensor_parallel=4 must divide groups (2): heads and their B/C groups "
        "are split between tensor-parallel ranks"
    ) in str(error.value)


def test_registration_and_capabilities():
    check_registered("mixer", "discrete_mamba_2", DiscreteMamba2Config, "DiscreteMamba2", CAPABILITIES)
    assert isinstance(configs.structure({"type": "discrete_mamba_2", "heads": 4}, MixerConfig), DiscreteMamba2Config)


def test_config_module_imports_no_torch():
    check_imports_no_torch("blockzoo_discrete_mamba_2.config", "blockzoo_discrete_mamba_2.plugin")


def test_check_environment_reports_cuda_without_mamba_ssm(monkeypatch):
    import torch

    import blockzoo_ssm

    monkeypatch.setattr(blockzoo_ssm, "mamba_ssm_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert plugin.check_environment() == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    (problem,) = plugin.check_environment()
    assert "mamba_ssm does not import" in problem and "blockzoo-discrete-mamba-2[kernels]" in problem
    monkeypatch.setattr(blockzoo_ssm, "mamba_ssm_available", lambda: True)
    assert plugin.check_environment() == []
