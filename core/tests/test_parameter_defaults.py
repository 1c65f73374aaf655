"""Parents pass defaults, children override: initialization, lr_scale (multiplied), bias, weight decay, PEFT;
and an initialization type registered by a plugin is used by the parameter factory."""

import types

import torch

from blockzoo import config
from blockzoo.api import InitializationConfig, configclass, field, hookimpl
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.config import ZEROS, LinearConfig, NormalInitializationConfig
from blockzoo.layers.dims import TensorDim
from blockzoo.layers.linear import Linear
from blockzoo.plugins import register_plugin

PARENT_INIT = NormalInitializationConfig(std=0.5)


def linear(data: dict) -> LinearConfig:
    return config.structure(data, LinearConfig)


def test_lr_scale_multiplies_down_the_tree():
    settings = linear({"lr_scale": 0.5, "weight": {"lr_scale": 0.25}}).resolve_weight(
        initialization=PARENT_INIT, lr_scale=2.0
    )
    assert settings.lr_scale == 2.0 * 0.5 * 0.25
    assert linear({}).resolve_weight(initialization=PARENT_INIT, lr_scale=3.0).lr_scale == 3.0
    assert linear({"lr_scale": 0}).resolve_weight(initialization=PARENT_INIT, lr_scale=3.0).frozen


def test_initialization_and_weight_decay_defaults_come_from_the_parent():
    default = linear({}).resolve_weight(initialization=PARENT_INIT)
    assert default.initialization == PARENT_INIT and default.weight_decay is True
    own = linear({"weight": {"initialization": {"type": "uniform", "low": -1, "high": 1}, "weight_decay": False}})
    settings = own.resolve_weight(initialization=PARENT_INIT)
    assert settings.initialization.explicit_fields() == {"low", "high"} and settings.weight_decay is False


def test_bias_follows_add_linear_biases_unless_set():
    assert linear({}).resolve_bias(enabled=False) is None
    bias = linear({}).resolve_bias(enabled=True, lr_scale=0.5)
    assert bias.initialization == ZEROS and bias.weight_decay is False and bias.lr_scale == 0.5
    assert linear({"bias": {"enabled": True}}).resolve_bias(enabled=False) is not None
    assert linear({"bias": {"enabled": False}}).resolve_bias(enabled=True) is None
    assert linear({"bias": {"enabled": True, "weight_decay": True}}).resolve_bias(enabled=False).weight_decay


def test_apply_peft_defaults_to_the_parent():
    assert linear({}).use_peft(True) and not linear({}).use_peft(False)
    assert not linear({"apply_peft": False}).use_peft(True)


@configclass
class ArangeInitializationConfig(InitializationConfig):
    step: float = field(1.0)


def initialize_arange(tensor: torch.Tensor, config: ArangeInitializationConfig, generator: torch.Generator) -> None:
    with torch.no_grad():
        tensor.copy_(torch.arange(tensor.numel(), dtype=tensor.dtype).view_as(tensor) * config.step)


@hookimpl
def _register_components(register):
    register("demo.arange", ArangeInitializationConfig, f"{__name__}:initialize_arange")


def test_a_plugin_initialization_is_used_by_the_parameter_factory(fresh_registry):
    register_plugin(types.SimpleNamespace(register_components=_register_components), "demo")
    layer_config = linear({"weight": {"initialization": {"type": "demo.arange", "step": 0.5}}})
    layer = Linear(
        "layer",
        layer_config,
        TensorDim("in", 3),
        TensorDim("out", 2),
        Distributed(DistributedConfig()),
        default_initialization=PARENT_INIT,
    )
    assert torch.equal(layer.weight.detach(), torch.arange(6.0).view(2, 3) * 0.5)
