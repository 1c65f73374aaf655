"""A layer that lacks a contract method says which one, of which layer type, and what it is for."""

import pytest

from blockzoo.api import Batch, MixerConfig, MLPConfig, configclass
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.base import MLP, Mixer
from blockzoo.layers.dims import TensorDim


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
