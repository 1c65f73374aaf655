"""The top-level config of a run (`blockzoo train CONFIG`). Torch-free."""

from __future__ import annotations

from blockzoo.config import Config, configclass, field
from blockzoo.distributed.config import DistributedConfig
from blockzoo.model.config import ModelConfig


@configclass
class RunConfig(Config):
    model: ModelConfig = field(factory=ModelConfig, doc="The model to build.")
    distributed: DistributedConfig = field(factory=DistributedConfig, doc="Parallel layout and numerics.")
