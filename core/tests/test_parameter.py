"""Initializations and the parameter factory in one process (the sharded layouts: test_linear_parallel.py)."""

import pytest
import torch
from torch import nn

import blockzoo.layers.parameter
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.config import (
    FillInitializationConfig,
    LinearConfig,
    NormalInitializationConfig,
    ParameterConfig,
    ResolvedParameter,
    UniformInitializationConfig,
)
from blockzoo.layers.dims import ConcatenatedTensorDim, TensorDim
from blockzoo.layers.initialization import initialize_fill, initialize_normal, initialize_uniform
from blockzoo.layers.linear import Linear
from blockzoo.layers.parameter import create_parameter, initialize_parameter, materialize, uninitialized

NORMAL = NormalInitializationConfig(std=0.1)


def _single(seed=1234):
    return Distributed(DistributedConfig(seed=seed, backend="gloo"), world_size=1, rank=0, local_rank=0)


def _settings(initialization=NORMAL, lr_scale=1.0, weight_decay=True):
    return ResolvedParameter(initialization=initialization, lr_scale=lr_scale, weight_decay=weight_decay)


def _generator(seed=0):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------------------------------
# Initializations


def test_normal_matches_its_config_and_the_generator():
    config = NormalInitializationConfig(mean=0.5, std=2.0)
    first, second = torch.empty(100_000), torch.empty(100_000)
    initialize_normal(first, config, _generator())
    initialize_normal(second, config, _generator())
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    assert first.mean().item() == pytest.approx(0.5, abs=0.05)
    assert first.std().item() == pytest.approx(2.0, rel=0.02)


def test_truncated_normal_stays_within_bounds():
    config = NormalInitializationConfig(mean=1.0, std=0.5, truncate=2.0)
    tensor = torch.empty(100_000)
    initialize_normal(tensor, config, _generator())
    assert tensor.min().item() >= 0.0 and tensor.max().item() <= 2.0
    assert tensor.min().item() < 0.05 and tensor.max().item() > 1.95  # Truncated, not squeezed.


def test_uniform_and_fill():
    tensor = torch.empty(10_000)
    initialize_uniform(tensor, UniformInitializationConfig(low=-3.0, high=-1.0), _generator())
    assert tensor.min().item() >= -3.0 and tensor.max().item() <= -1.0
    assert tensor.std().item() == pytest.approx(2.0 / 12**0.5, rel=0.05)
    initialize_fill(tensor, FillInitializationConfig(value=0.25), _generator())
    torch.testing.assert_close(tensor, torch.full_like(tensor, 0.25), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------------
# The parameter factory


def test_initialization_is_reproducible_and_depends_on_name_and_seed():
    dims = (TensorDim("out", 6), TensorDim("in", 4))

    def make(name, seed=1234):
        return create_parameter(name, dims, _settings(), _single(seed)).detach()

    reference = make("block.weight")
    torch.testing.assert_close(make("block.weight"), reference, rtol=0, atol=0)
    assert not torch.equal(make("block.other"), reference)
    assert not torch.equal(make("block.weight", seed=99), reference)


def test_parameter_metadata():
    dims = (TensorDim("out", 6), TensorDim("in", 4))
    parameter = create_parameter("layer.weight", dims, _settings(lr_scale=0.5, weight_decay=False), _single())
    meta = parameter.meta
    assert parameter.shape == meta.local_shape == meta.global_shape == (6, 4)
    assert meta.name == "layer.weight" and meta.dims == dims
    assert meta.uniform and meta.settings[0].lr_scale == 0.5 and not meta.settings[0].weight_decay
    assert not meta.tensor_parallel and not meta.reduce_gradient_over_tensor_group
    assert parameter.requires_grad


def test_per_component_settings_are_honoured():
    key, value = TensorDim("key", 4, parallel=True), TensorDim("value", 2, parallel=True)
    dims = (ConcatenatedTensorDim("key_value", [key, value]), TensorDim("hidden", 3))
    settings = [
        _settings(FillInitializationConfig(value=0.5), lr_scale=0.0, weight_decay=False),
        _settings(UniformInitializationConfig(low=2.0, high=3.0), lr_scale=2.0),
    ]
    parameter = create_parameter("attention.key_value.weight", dims, settings, _single())
    torch.testing.assert_close(parameter[:4].detach(), torch.full((4, 3), 0.5), rtol=0, atol=0)
    assert parameter[4:].min().item() >= 2.0 and parameter[4:].max().item() <= 3.0
    meta = parameter.meta
    assert parameter.requires_grad and not meta.uniform  # One component frozen, the other trained.
    torch.testing.assert_close(meta.lr_scale_rows(), torch.tensor([0.0] * 4 + [2.0] * 2).view(6, 1))
    torch.testing.assert_close(meta.weight_decay_rows(), torch.tensor([0.0] * 4 + [1.0] * 2).view(6, 1))
    assert (meta.lr_scale_rows() * torch.ones(6, 3)).shape == (6, 3)


def test_settings_count_must_match_the_components():
    with pytest.raises(ValueError, match=r"'p'.*2 settings need a first dim concatenated from 2 components"):
        create_parameter("p", (TensorDim("out", 4),), [_settings(), _settings()], _single())


def test_lr_scale_zero_freezes():
    parameter = create_parameter("frozen", (TensorDim("out", 3),), _settings(lr_scale=0.0), _single())
    assert not parameter.requires_grad
    linear = Linear(
        "frozen_linear",
        LinearConfig(lr_scale=0.0),
        TensorDim("in", 3),
        TensorDim("out", 2),
        _single(),
        default_initialization=NORMAL,
        default_bias=True,
    )
    assert not linear.weight.requires_grad and not linear.bias.requires_grad


def test_meta_device_then_materialize_gives_the_direct_weights():
    distributed = _single()
    config = LinearConfig(weight=ParameterConfig(initialization=UniformInitializationConfig()))
    args = ("mlp.up", config, TensorDim("hidden", 4), TensorDim("intermediate", 6), distributed)
    direct = Linear(*args, default_initialization=NORMAL, default_bias=True)
    lazy = Linear(*args, default_initialization=NORMAL, default_bias=True, device="meta")
    assert lazy.weight.is_meta and lazy.weight.meta.global_shape == (6, 4)
    lazy.extra = nn.Module()
    lazy.extra.tied = lazy.weight  # Tied parameters stay tied.
    materialize(lazy, distributed)
    assert not lazy.weight.is_meta and lazy.extra.tied is lazy.weight
    torch.testing.assert_close(lazy.weight.detach(), direct.weight.detach(), rtol=0, atol=0)
    torch.testing.assert_close(lazy.bias.detach(), direct.bias.detach(), rtol=0, atol=0)
    assert lazy.weight.meta == direct.weight.meta


def test_initialize_parameter_restores_the_initial_values():
    distributed = _single()
    parameter = create_parameter("w", (TensorDim("out", 5),), _settings(), distributed)
    initial = parameter.detach().clone()
    with torch.no_grad():
        parameter.zero_()
    initialize_parameter(parameter, distributed)
    torch.testing.assert_close(parameter.detach(), initial, rtol=0, atol=0)


def test_parameters_made_uninitialized_skip_only_the_initialization(monkeypatch):
    distributed = _single()
    initialized = []
    original = blockzoo.layers.parameter.initialize_parameter

    def spy(parameter, distributed):
        initialized.append(parameter.meta.name)
        original(parameter, distributed)

    monkeypatch.setattr(blockzoo.layers.parameter, "initialize_parameter", spy)
    reference = create_parameter("w", (TensorDim("out", 5),), _settings(), distributed)
    with uninitialized():
        skipped = create_parameter("w", (TensorDim("out", 5),), _settings(), distributed)
        with uninitialized(False):  # does not turn it back on
            create_parameter("v", (TensorDim("out", 5),), _settings(), distributed)
    with uninitialized(False):
        again = create_parameter("w", (TensorDim("out", 5),), _settings(), distributed)
    assert initialized == ["w", "w"]
    assert skipped.meta.name == "w" and skipped.shape == reference.shape and skipped.requires_grad
    torch.testing.assert_close(again.detach(), reference.detach(), rtol=0, atol=0)
