"""The Mamba 2 config: defaults, errors that name the field, tensor-parallel refusals (also through RunConfig),
registration, `blockzoo plugins` listing the type, and a torch-free config module."""

import json
import math
import subprocess
import sys

import pytest
import yaml

from blockzoo import config as configs
from blockzoo.api import MixerConfig
from blockzoo.run_config import RunConfig
from blockzoo_mamba_2 import plugin
from blockzoo_mamba_2.config import Mamba2Config
from blockzoo_testing import check_config_error, check_imports_no_torch, check_registered

# What the mixer declares: every kind of parallelism and a generation cache.
CAPABILITIES = {"tensor_parallel", "sequence_tensor_parallel", "sequence_data_parallel", "generation_cache"}


def structure(data: dict) -> Mamba2Config:
    return configs.structure(data, Mamba2Config)


def test_defaults_follow_mamba_ssm():
    config = structure({})
    assert config == Mamba2Config()
    assert (config.heads, config.head_size, config.groups, config.state_size, config.chunk_size) == (8, 64, 1, 128, 256)
    assert config.inner_size == 512 and config.norm_group_size == 512
    assert config.convolution.kernel_size == 4 and config.convolution.has_bias
    assert config.dt_limit == (0.0, math.inf) and not config.d_per_channel
    assert config.normalization.epsilon == 1e-5 and config.normalization.per_group
    assert config.normalization.enabled and not config.normalization.norm_before_gate  # RMSNorm(y · silu(z))
    assert not any(config.has_bias(getattr(config, name)) for name in ("z", "x", "b", "c", "dt", "out_proj"))


def test_norm_group_size():
    assert structure({"heads": 8, "head_size": 4, "groups": 2}).norm_group_size == 16
    assert (
        structure({"heads": 8, "head_size": 4, "groups": 2, "normalization": {"per_group": False}}).norm_group_size
        == 32
    )


def test_dt_limit_reads_yaml_lists_and_infinity():
    assert structure(yaml.safe_load("dt_limit: [1.0e-3, .inf]")).dt_limit == (0.001, math.inf)
    assert structure({"dt_limit": [0, 0.5]}).dt_limit == (0.0, 0.5)


def test_conv_bias_does_not_follow_add_linear_biases():
    config = structure({"add_linear_biases": True, "convolution": {"bias": {"enabled": False}}})
    assert not config.convolution.has_bias
    assert all(config.has_bias(getattr(config, name)) for name in ("z", "x", "b", "c", "dt", "out_proj"))
    assert structure({"add_linear_biases": False}).convolution.has_bias


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"heads": 0}, "heads: must be >= 1, got 0"),
        ({"heads": 6, "groups": 4}, r"groups: must divide heads \(6\), got 4"),
        ({"heads": 2, "groups": 4}, r"groups: must be <= heads \(2\), got 4"),
        ({"state_size": 0}, "state_size: must be >= 1, got 0"),
        ({"chunk_size": 0}, "chunk_size: must be >= 1, got 0"),
        ({"convolution": {"kernel_size": 0}}, "convolution.kernel_size: must be >= 1, got 0"),
        ({"dt_limit": [0.5, 0.1]}, r"dt_limit: must be \[min, max\] with 0 <= min < max, got \[0.5, 0.1\]"),
        ({"dt_limit": [-1, 1]}, r"dt_limit: must be \[min, max\] with 0 <= min < max"),
        ({"dt_limit": [0.1]}, "dt_limit: expected a list of 2 numbers, got 1"),
        ({"normalization": {"epsilon": -1}}, "normalization.epsilon: must be >= 0"),
        (
            {"normalization": {"enabled": False, "norm_before_gate": True}},
            r"normalization\.norm_before_gate: true orders a norm and the gate, but there is no norm",
        ),
        ({"x": {"bias": {"enabled": True}}}, r"x.bias.enabled: z, x, b, c and dt are one fused in_proj weight"),
        ({"add_linear_biases": True, "dt": {"bias": {"enabled": False}}}, "dt.bias.enabled: z, x, b, c and dt are one"),
        ({"d_has_hdim": True}, "d_has_hdim: unknown key"),
    ],
)
def test_errors_name_the_field(data, message):
    check_config_error(Mamba2Config, data, message)


def test_in_proj_biases_all_on_or_all_off():
    config = structure({"add_linear_biases": True, "out_proj": {"bias": {"enabled": False}}})
    assert config.has_bias(config.z) and not config.has_bias(config.out_proj)


def test_check_tensor_parallel():
    structure({"heads": 8, "groups": 4}).check_tensor_parallel(4)
    structure({"normalization": {"per_group": False}}).check_tensor_parallel(1)
    with pytest.raises(configs.ConfigFieldError, match=r"tensor_parallel=2 must divide groups \(1\)"):
        structure({}).check_tensor_parallel(2)
    with pytest.raises(configs.ConfigFieldError, match="false normalizes over the whole inner dimension"):
        structure({"groups": 2, "normalization": {"per_group": False}}).check_tensor_parallel(2)
    # Without a norm there are no statistics to split.
    structure({"groups": 2, "normalization": {"enabled": False, "per_group": False}}).check_tensor_parallel(2)


def _run_config(mixer: dict, **distributed) -> dict:
    return {
        "model": {
            "hidden_size": 32,
            "decoder": {
                "type": "pattern",
                "num_blocks": 2,
                "pattern": ["ssm", "other"],
                "blocks": {
                    "ssm": {"mixer": {"type": "mamba_2", **mixer}, "mlp": {"type": "none"}},
                    "other": {"mixer": {"type": "mamba_2", "groups": 2}, "mlp": {"type": "none"}},
                },
            },
        },
        "distributed": distributed,
    }


@pytest.mark.parametrize(
    ("mixer", "message"),
    [
        ({"groups": 1}, r"model\.decoder\.blocks\.ssm\.mixer\.groups: tensor_parallel=2 must divide groups \(1\)"),
        (
            {"groups": 2, "normalization": {"per_group": False}},
            r"model\.decoder\.blocks\.ssm\.mixer\.normalization\.per_group: false normalizes over the whole inner",
        ),
    ],
)
def test_run_config_refuses_layouts_the_mixer_cannot_run(mixer, message):
    with pytest.raises(configs.ConfigError, match=message):
        configs.structure(_run_config(mixer, tensor_parallel=2, sequence_tensor_parallel=True), RunConfig)
    configs.structure(_run_config(mixer), RunConfig)  # Fine on one rank.
    configs.structure(_run_config({"groups": 2}, tensor_parallel=2, sequence_tensor_parallel=True), RunConfig)


def test_registration_and_capabilities():
    check_registered("mixer", "mamba_2", Mamba2Config, "Mamba2", CAPABILITIES)
    assert isinstance(configs.structure({"type": "mamba_2"}, MixerConfig), Mamba2Config)


def test_blockzoo_plugins_lists_and_checks_mamba_2():
    """The installed command in a fresh process: the entry point is found, the type listed, and `--check` builds
    its default config (other plugins' results are theirs)."""
    result = subprocess.run(
        [sys.executable, "-m", "blockzoo", "plugins", "--json", "--check"], capture_output=True, text=True
    )
    plugins = {record["name"]: record for record in json.loads(result.stdout)["plugins"]}
    record = plugins["mamba_2"]
    assert record["distribution"] == "blockzoo-mamba-2" and record["status"] == "loaded", record
    assert record["types"] == {"mixer": ["mamba_2"]}, record
    # Building the default config raised nothing; the only possible problem is a CUDA machine without mamba_ssm.
    assert record["check"] == plugin.check_environment(), record


def test_config_module_imports_no_torch():
    check_imports_no_torch("blockzoo_mamba_2.config", "blockzoo_mamba_2.plugin")
