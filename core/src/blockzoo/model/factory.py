"""The Python API: `blockzoo.build(config)`, `blockzoo.load(path)`, `blockzoo.save(model, path)`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from blockzoo.config import ConfigError, load, structure
from blockzoo.distributed.runtime import Distributed
from blockzoo.model.config import ModelConfig
from blockzoo.model.language_model import LanguageModel
from blockzoo.run_config import RunConfig


def as_run_config(config: RunConfig | ModelConfig | Mapping | str | Path) -> RunConfig:
    """A run config from a run config, a model config, plain data of a run config, or a YAML file."""
    if isinstance(config, RunConfig):
        return config
    if isinstance(config, ModelConfig):
        return RunConfig(model=config)
    if isinstance(config, Mapping):
        return structure(config, RunConfig)
    if isinstance(config, (str, Path)):
        return load(RunConfig, config)
    raise ConfigError([("", f"expected a RunConfig, ModelConfig, mapping or YAML path, got {type(config).__name__}")])


def build(
    config: RunConfig | ModelConfig | Mapping | str | Path, *, distributed: Distributed | None = None
) -> LanguageModel:
    """Build a model with freshly initialized weights (reproducible from `distributed.seed`)."""
    run_config = as_run_config(config)
    return LanguageModel(run_config.model, distributed or Distributed(run_config.distributed))
