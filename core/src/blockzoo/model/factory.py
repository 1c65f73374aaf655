"""The Python API: `blockzoo.build(config)`, `blockzoo.load(path)`, `blockzoo.save(model, path)`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from blockzoo.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint_config,
    save_checkpoint,
)
from blockzoo.config import ConfigError, merge, structure
from blockzoo.config import load as load_config
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
        return load_config(RunConfig, config)
    raise ConfigError([("", f"expected a RunConfig, ModelConfig, mapping or YAML path, got {type(config).__name__}")])


def build(
    config: RunConfig | ModelConfig | Mapping | str | Path, *, distributed: Distributed | None = None
) -> LanguageModel:
    """Build a model with freshly initialized weights (reproducible from `distributed.seed`)."""
    run_config = as_run_config(config)
    model = LanguageModel(run_config.model, distributed or Distributed(run_config.distributed))
    model.run_config = run_config
    return model


def load(path: str | Path, *, distributed: Distributed | None = None) -> LanguageModel:
    """A model from a native checkpoint directory, or a run's output directory (its latest checkpoint).

    Without `distributed`, the model runs in this process alone, whatever parallel layout saved the checkpoint
    (its tensors are global); pass a `Distributed` to load it into a parallel layout.
    """
    directory = _checkpoint_directory(Path(path))
    data = read_checkpoint_config(directory)
    if distributed is None:
        data = merge(data, {"distributed": {"tensor_parallel": 1, "sequence_tensor_parallel": False}})
    run_config = structure(data, RunConfig, source=str(directory / "config.yaml"))
    model = build(run_config, distributed=distributed or Distributed(run_config.distributed, world_size=1, rank=0))
    load_checkpoint(directory, model=model, distributed=model.distributed)
    return model


def save(model: LanguageModel, path: str | Path, *, format: str = "blockzoo") -> Path:
    """Write `model` as a native checkpoint (weights and config) at `path`."""
    if format != "blockzoo":
        raise ValueError(f"unknown checkpoint format {format!r}; available: blockzoo")
    run_config = getattr(model, "run_config", None) or RunConfig(
        model=model.config, distributed=model.distributed.config
    )
    save_checkpoint(Path(path), model=model, run_config=run_config, step=0, distributed=model.distributed)
    return Path(path)


def _checkpoint_directory(path: Path) -> Path:
    if (path / "metadata.yaml").is_file():
        return path
    if (path / "config.json").is_file():
        raise CheckpointError(path, "is a Hugging Face checkpoint; importing it needs the blockzoo-huggingface plugin")
    latest = latest_checkpoint(path) if path.is_dir() else None
    if latest is None:
        raise CheckpointError(path, "is not a checkpoint (no metadata.yaml) nor a run directory holding checkpoints")
    return latest
