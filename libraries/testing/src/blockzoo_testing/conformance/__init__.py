"""The conformance kit: base test classes that check a mixer or MLP plugin against blockzoo's layer contract.

A plugin author subclasses one in a test module and provides a small config of the plugin's type::

    from blockzoo_testing import MixerConformance

    class TestGatedConv(MixerConformance):
        def config_factory(self):
            return {"type": "shortconv.gated_conv", "channels": 16, "kernel_size": 3}

pytest then runs every inherited `test_*` method on it. Each failure says what is wrong and what to change.
Options are class attributes (`hidden_size`, `lengths`, `tolerance`, `tensor_parallel_sizes`, `field_changes`,
`field_exceptions`, `seed`); see `LayerConformance`. The checks (docs/plugins/write-a-mixer.md lists them):

- discovery: the type is registered by an installed distribution through its `blockzoo.plugins` entry point, its
  implementation is a `Mixer` / `MLP`, `plugin_info` lists the type's capabilities;
- config: plain data ↔ config round trip (also through YAML), unknown keys refused, every field documented, the
  default config builds, the config and hook modules import no torch;
- the layer: output shape and dtype (fp32 and bf16), construction on the meta device then `materialize`, packed
  documents equal separate runs (outputs and gradients), a padded batch (what CUDA graphs run) equals the exact one,
  every config field changes the parameters or the outputs, every trainable parameter receives a gradient, the layer
  survives deepcopy, .to(dtype), .to("meta") and a state_dict round trip;
- declared capabilities: `tensor_parallel` (and `sequence_tensor_parallel`) on gloo ranks against one process,
  outputs and every gradient; `generation_cache`: prefill then token by token equals the full forward;
  `sequence_data_parallel`: the batch cut into slices run one after the other (`forward_slice`, carries passed on)
  equals the whole forward, and split over 2 and 4 gloo ranks (with and without micro-sequences) equals one process,
  on generated batches whose every slice continues a document (`blockzoo_testing.layouts`);
- a model using the layer survives a checkpoint save / load; `flops` is reported and scales with the tokens.

The pieces these checks are made of serve a plugin's own tests too: `blockzoo_testing.layers` (build a layer, run
it, compare it) and `blockzoo_testing.parallel` (`check_tensor_parallel` on many cases at once).
"""

from __future__ import annotations

from blockzoo.layers.base import MLP, Mixer
from blockzoo.layers.config import MixerConfig, MLPConfig
from blockzoo_testing.conformance.capability_checks import CapabilityChecks
from blockzoo_testing.conformance.config_checks import ConfigChecks
from blockzoo_testing.conformance.layer_checks import LayerChecks
from blockzoo_testing.conformance.sections import ConverterSectionConformance

__all__ = ["ConverterSectionConformance", "LayerConformance", "MLPConformance", "MixerConformance"]


class LayerConformance(ConfigChecks, LayerChecks, CapabilityChecks):
    """Checks shared by mixers and MLPs. Subclass `MixerConformance` or `MLPConformance`, not this."""


class MixerConformance(LayerConformance):
    """The conformance checks of a mixer plugin (also: decoding with `new_state` when it declares generation_cache)."""

    kind = "mixer"
    kind_config = MixerConfig
    layer_base = Mixer


class MLPConformance(LayerConformance):
    """The conformance checks of an MLP plugin."""

    kind = "mlp"
    kind_config = MLPConfig
    layer_base = MLP
