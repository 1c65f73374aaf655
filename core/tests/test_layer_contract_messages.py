"""A layer that lacks a contract method says which one, of which layer type, and what it is for."""

from types import SimpleNamespace

import pytest

from blockzoo.api import Batch, MixerConfig, MLPConfig, check, configclass
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.base import MLP, Mixer
from blockzoo.layers.dims import TensorDim
from blockzoo.model.block import check_layout


@configclass
class BareMixerConfig(MixerConfig):
    pass


@configclass
class CachingMixerConfig(MixerConfig):
    capabilities = frozenset({"generation_cache"})


@configclass
class BareMLPConfig(MLPConfig):
    pass


def _build(layer_class, config):
    distributed = Distributed(DistributedConfig(backend="gloo"), world_size=1, rank=0, local_rank=0)
    return layer_class(config, name="layer", hidden_dim=TensorDim("hidden", 8), distributed=distributed, lr_scale=1.0)


def test_a_mixer_without_new_state_names_the_method():
    with pytest.raises(NotImplementedError, match=r"mixer type 'Mixer' does not implement new_state\(num_sequences"):
        _build(Mixer, BareMixerConfig()).new_state(1, 4, "cpu", None)


def test_a_mixer_declaring_generation_cache_without_new_state_says_so():
    with pytest.raises(
        NotImplementedError, match="mixer type 'Mixer' declares generation_cache but does not implement"
    ):
        _build(Mixer, CachingMixerConfig()).new_state(1, 4, "cpu", None)


@pytest.mark.parametrize(
    ("layer_class", "config", "kind"), [(Mixer, BareMixerConfig(), "mixer"), (MLP, BareMLPConfig(), "MLP")]
)
def test_a_layer_without_flops_or_forward_names_the_method(layer_class, config, kind):
    layer = _build(layer_class, config)
    with pytest.raises(
        NotImplementedError, match=rf"{kind} type '{layer_class.__name__}' does not implement flops\(batch\)"
    ):
        layer.flops(Batch([3]))
    with pytest.raises(NotImplementedError, match=rf"{kind} type '{layer_class.__name__}' does not implement forward"):
        layer(None, Batch([3]))


@configclass
class EvenOnlyMixerConfig(MixerConfig):
    capabilities = frozenset({"tensor_parallel"})

    def check_tensor_parallel(self, tensor_parallel: int) -> None:
        check(tensor_parallel == 2, "width", f"tensor_parallel={tensor_parallel} must be 2")


@pytest.mark.parametrize(
    ("config", "size", "message"),
    [
        (
            EvenOnlyMixerConfig(),
            4,
            r"mixer 'decoder\.0\.mixer' \(type 'EvenOnlyMixerConfig'\): width: tensor_parallel=4 must be 2",
        ),
        (
            BareMixerConfig(),
            2,
            r"mixer 'decoder\.0\.mixer' \(type 'BareMixerConfig'\) does not support tensor-parallel",
        ),
    ],
)
def test_the_engine_refuses_a_split_before_the_layer_is_built(config, size, message):
    """The engine's check of a config's check_tensor_parallel (and its capabilities), before any layer exists."""
    with pytest.raises(ValueError, match=message):
        check_layout(config, "decoder.0.mixer", SimpleNamespace(tensor_size=size))
    check_layout(EvenOnlyMixerConfig(), "decoder.0.mixer", SimpleNamespace(tensor_size=2))  # accepted
    check_layout(BareMixerConfig(), "decoder.0.mixer", SimpleNamespace(tensor_size=1))  # nothing to split


def test_build_part_runs_the_check_before_building(blockzoo_registry):
    """A registered type: build_part refuses a split its config refuses, with the config's message, before the
    implementation runs (which would need a tensor-parallel process group, and records that it was called)."""
    import types

    from blockzoo.api import hookimpl
    from blockzoo.config import structure
    from blockzoo.model.block import build_part
    from blockzoo.plugins import register_plugin

    module = types.ModuleType("contract_test_plugin")
    module.register_mixers = hookimpl(
        lambda register: register("contract.even", EvenOnlyMixerConfig, f"{__name__}:Built")
    )
    register_plugin(module, "contract")
    config = structure({"type": "contract.even"}, MixerConfig)
    Built.calls.clear()
    with pytest.raises(ValueError, match=r"mixer 'decoder\.0\.mixer' \(type 'contract\.even'\): width: .* must be 2"):
        build_part(
            config,
            name="decoder.0.mixer",
            hidden_dim=TensorDim("hidden", 12),
            distributed=SimpleNamespace(tensor_size=4),
            lr_scale=1.0,
        )
    assert Built.calls == []


class Built:
    """Stands for a layer: records that it was built."""

    calls: list = []

    def __init__(self, *args, **kwargs):
        Built.calls.append(kwargs["name"])
