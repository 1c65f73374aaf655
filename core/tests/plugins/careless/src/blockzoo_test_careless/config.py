"""A config module that imports torch (what `blockzoo plugins --check` must report)."""

import torch  # noqa: F401

from blockzoo.api import MixerConfig, configclass


@configclass
class CarelessMixerConfig(MixerConfig):
    """A toy config."""
