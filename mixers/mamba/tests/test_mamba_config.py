"""The Mamba config: defaults, errors that name the field, tensor-parallel layouts refused by the run config,
registration, and a torch-free config module."""

import pytest

from blockzoo import config as configs
from blockzoo.api import MixerConfig
from blockzoo.run_config import RunConfig
from blockzoo_mamba.config import MambaConfig
from blockzoo_testing import check_config_error, check_imports_no_torch, check_registered

# What the mixer declares: every kind of parallelism and a generation cache.
CAPABILITIES = {"tensor_parallel", "sequence_tensor_parallel", "sequence_data_parallel", "generation_cache"}


def structure(data: dict) -> MambaConfig:
    return configs.structure(data, MambaConfig)


def test_defaults_follow_mamba_ssm():
    config = structure({})
    assert config == MambaConfig()
    assert (config.state_size, config.convolution.kernel_size) == (16, 4)
    assert (config.dt_init, config.dt_scale) == ("random", 1.0)
    # inner = 2 × hidden, dt_rank = ceil(hidden / 16), unless given.
    assert (config.resolved_inner_size(64), config.resolved_dt_rank(64), config.resolved_dt_rank(65)) == (128, 4, 5)
    assert structure({"expand": 3}).resolved_inner_size(64) == 192
    assert structure({"inner_size": 5, "dt_rank": 2}).resolved_inner_size(64) == 5
    assert structure({"dt_rank": 2}).resolved_dt_rank(64) == 2
    assert not config.grouped and config.in_proj_components == ("x", "z")
    assert structure({"xb_size": 32}).in_proj_components == ("z", "x", "b", "c")
    assert config.convolution.has_bias and config.has_dt_bias
    assert not any(config.has_bias(getattr(config, name)) for name in ("x", "z", "out_proj", "dt_in_proj"))
    with_biases = structure({"add_linear_biases": True})
    assert all(with_biases.has_bias(getattr(with_biases, name)) for name in ("x", "z", "out_proj", "dt_in_proj"))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"state_size": 0}, "state_size: must be >= 1, got 0"),
        ({"inner_size": 32, "expand": 2}, r"expand: give inner_size \(32\) or expand \(2\), not both"),
        ({"state_size": 4, "xb_size": 10}, r"xb_size: must be a multiple of state_size \(4\)"),
        ({"state_size": 4, "xb_size": 8, "inner_size": 18}, r"inner_size: the grouped layout splits it into heads"),
        ({"state_size": 4, "xb_size": 8, "inner_size": 20}, r"xb_size: its heads \(2\) must divide the heads of "),
        ({"xb_size": 16, "x_proj": {"lr_scale": 0.5}}, r"x_proj: the grouped layout \(xb_size\) has no x_proj"),
        ({"b": {"lr_scale": 0.5}}, r"b: only for the grouped layout \(set xb_size\)"),
        ({"dt_in_proj": {"lr_scale": 0.5}}, r"dt_in_proj: only for the grouped layout"),
        ({"repeat_xb_before_convolution": False}, r"repeat_xb_before_convolution: only for the grouped layout"),
        ({"dt_proj": {"bias": {"enabled": True}}}, r"dt_proj\.bias\.enabled: the time step's bias is `dt_bias`"),
        ({"dt_proj": {"weight": {"initialization": {}}}, "dt_scale": 2.0}, "dt_scale: dt_proj.weight.initialization"),
        ({"dt_proj": {"weight": {"initialization": {}}}, "dt_init": "constant"}, "dt_init: dt_proj.weight.initial"),
        ({"dt_scale": 0.0}, "dt_scale: must be > 0"),
        ({"dt_init": "zeros"}, "dt_init: expected one of 'random', 'constant'"),
        ({"z": {"bias": {"enabled": True}}}, r"z\.bias\.enabled: x and z are one fused in_proj weight"),
        ({"xb_size": 16, "add_linear_biases": True, "c": {"bias": {"enabled": False}}}, r"c\.bias\.enabled: z, x, b"),
        ({"convolution": {"kernel_size": 0}}, r"convolution\.kernel_size: must be >= 1, got 0"),
        ({"b_norm": {"type": "batch_norm"}}, r"b_norm\.type: unknown normalization type 'batch_norm'"),
        ({"state": 4}, "state: unknown key"),
    ],
)
def test_errors_name_the_field(data, message):
    check_config_error(MambaConfig, data, message)


def _run_config(mixer: dict, tensor_parallel: int, **distributed) -> dict:
    block = {"mixer": {"type": "mamba", **mixer}, "mlp": {"type": "none"}}
    model = {"hidden_size": 16, "embeddings": {"vocab_size": 32}, "decoder": {"num_blocks": 1, "block": block}}
    return {"model": model, "distributed": {"tensor_parallel": tensor_parallel, **distributed}}


@pytest.mark.parametrize(
    ("mixer", "message"),
    [
        ({"inner_size": 30}, r"inner_size: tensor_parallel=4 must divide inner_size \(30\)"),
        ({"state_size": 4, "xb_size": 8}, r"xb_size: tensor_parallel=4 must divide the x/B heads .* = 2\)"),
        ({"state_size": 4, "xb_size": 8, "inner_size": 32}, r"xb_size: tensor_parallel=4 must divide the x/B heads"),
    ],
)
def test_a_layout_the_mixer_cannot_split_is_refused_by_the_run_config(mixer, message):
    with pytest.raises(configs.ConfigError, match=rf"model\.decoder\.block\.mixer\.{message}"):
        configs.structure(_run_config(mixer, 4, sequence_tensor_parallel=True), RunConfig)
    configs.structure(_run_config(mixer, 2, sequence_tensor_parallel=True), RunConfig)


def test_registration_and_capabilities():
    plugin = check_registered("mixer", "mamba", MambaConfig, "Mamba", CAPABILITIES)
    assert isinstance(configs.structure({"type": "mamba"}, MixerConfig), MambaConfig)
    assert plugin.distribution == "blockzoo-mamba" and plugin.types == {"mixer": ["mamba"]}


def test_config_module_imports_no_torch():
    check_imports_no_torch("blockzoo_mamba.config", "blockzoo_mamba.plugin")
