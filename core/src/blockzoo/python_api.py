"""The Python API (docs/python-api.md): `blockzoo.build(config)`, `blockzoo.load(path)`, `blockzoo.save(model,
path)`, and the conversions `blockzoo convert` runs."""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping
from pathlib import Path

import attrs

from blockzoo.checkpoint import CheckpointError, read_checkpoint_config, read_checkpoint_metadata, save_checkpoint
from blockzoo.config import ConfigError, structure
from blockzoo.config import load as load_config
from blockzoo.conversion import ConversionError, get_format
from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.parameter import uninitialized
from blockzoo.model.config import ModelConfig
from blockzoo.model.language_model import LanguageModel
from blockzoo.model.native import NATIVE, checkpoint_directory, checkpoint_format
from blockzoo.model.pretrained import start_from_pretrained, with_pretrained_config
from blockzoo.peft.apply import adapters, merged_weights
from blockzoo.run_config import RunConfig

# A preset's name (`qwen3_0_6b`, a third party's `acme.tiny`): no path separator and no YAML suffix, so a missing
# config file is still reported as one.
_PRESET_NAME = re.compile(r"[a-z][a-z0-9_]*(\.(?!ya?ml$)[a-z][a-z0-9_]*)?")


def as_run_config(config: RunConfig | ModelConfig | Mapping | str | Path) -> RunConfig:
    """A run config from a run config, a model config, plain data of a run config, a YAML file, or the name of a
    preset (`blockzoo models`) that is not a file here."""
    if isinstance(config, RunConfig):
        return config
    if isinstance(config, ModelConfig):
        return RunConfig(model=config)
    if isinstance(config, Mapping):
        return structure(config, RunConfig)
    if isinstance(config, str) and not Path(config).exists() and _PRESET_NAME.fullmatch(config):
        return structure({"model": {"preset": config}}, RunConfig)
    if isinstance(config, (str, Path)):
        return load_config(RunConfig, config)
    raise ConfigError([("", f"expected a RunConfig, ModelConfig, mapping or YAML path, got {type(config).__name__}")])


def build(
    config: RunConfig | ModelConfig | Mapping | str | Path, *, distributed: Distributed | None = None
) -> LanguageModel:
    """Build a model with freshly initialized weights (reproducible from `distributed.seed`), or, when
    `model.pretrained` names a checkpoint, with that checkpoint's architecture (updated with the other model fields
    given) and weights."""
    run_config = as_run_config(config)
    source = run_config.model.pretrained
    if source is not None:
        run_config = with_pretrained_config(run_config, source)
    with uninitialized(source is not None):  # the checkpoint has every weight
        model = _build_model(run_config, distributed)
    if source is not None:
        start_from_pretrained(model, source)
    return model


def _build_model(run_config: RunConfig, distributed: Distributed | None) -> LanguageModel:
    distributed = distributed or Distributed(run_config.distributed)
    try:
        model = LanguageModel(run_config.model, distributed)
    except (RuntimeError, MemoryError):  # the allocator's words: say which fields ask for too much, as `train` does
        from blockzoo.model.size import check_fits

        check_fits(run_config, distributed, training=False)
        raise
    model.run_config = run_config
    return model


def load(path: str | Path, *, distributed: Distributed | None = None) -> LanguageModel:
    """A model from a checkpoint of any installed format: a native checkpoint directory, a run's output directory
    (its latest checkpoint), or a checkpoint of another format a converter plugin reads (a Hugging Face directory:
    its format found from config.json).

    Without `distributed`, the model runs in this process alone, whatever parallel layout saved the checkpoint
    (its tensors are global); pass a `Distributed` to load it into a parallel layout.
    """
    path = Path(path)
    return checkpoint_format(path).load(path, distributed)


def save(
    model: LanguageModel,
    path: str | Path,
    *,
    format: str = "blockzoo",
    merged: bool = False,
    overwrite: bool = False,
    **options,
) -> Path:
    """Write `model` at `path` as a native checkpoint (weights and config), or in another `format` a converter
    plugin provides (e.g. `llama`; `options` are the format's, e.g. `dtype="bfloat16"`). Every rank calls it.

    `path` must be new or an empty directory, as `blockzoo convert` asks of its destination; with `overwrite`, a
    checkpoint there (of any format) is replaced, and a directory holding anything else is still refused.

    A model fine-tuned with PEFT is written in another format with its adapters merged into the weights (the format
    holds the model it computes); natively with its adapters, or with `merged` as a model without PEFT."""
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        if not overwrite:
            raise CheckpointError(path, "exists and is not empty; choose a new directory (or save with overwrite=True)")
        if not any((path / name).is_file() for name in ("metadata.yaml", "config.json")):
            raise CheckpointError(path, "holds something other than a checkpoint; refusing to replace it")
        if format != "blockzoo":
            shutil.rmtree(path)  # other formats write into a new directory; a native save replaces its own
    if any(True for _ in adapters(model)) and (merged or format != "blockzoo"):
        with merged_weights(model):
            return _save_without_peft(model, path, format, options)
    if format != "blockzoo":
        return get_format(format).save(model, Path(path), **options)
    run_config = getattr(model, "run_config", None) or RunConfig(
        model=model.config, distributed=model.distributed.config
    )
    save_checkpoint(
        Path(path), model=model, run_config=run_config, step=0, distributed=model.distributed, origin=model.origin
    )
    return Path(path)


def convert(
    source: str | Path, destination: str | Path, *, format: str | None = None, merged: bool = False, **options
) -> Path:
    """Convert a checkpoint: a native one (or a run's latest) into `format`, or one of another format into a native
    checkpoint (`format` None or "blockzoo") or into another `format` (through a native one). Streams the weights
    one tensor at a time: memory holds about one shard, not the model. `options` go to the exporting format.

    A native checkpoint of a PEFT fine-tuning is loaded whole and its adapters merged into the weights: into `format`,
    or, with `merged`, into a native checkpoint of the model without PEFT."""
    source, destination = Path(source), Path(destination)
    if not source.exists():
        raise CheckpointError(source, "does not exist")
    found = checkpoint_format(source)
    native = found is NATIVE
    if native and read_checkpoint_config(checkpoint_directory(source)).get("model", {}).get("peft"):
        return save(load(source), destination, format=format or "blockzoo", merged=True, **options)
    if merged:
        raise ConversionError(f"{source} is no PEFT fine-tuning (its model has no `peft`): there is nothing to merge")
    if native:
        if format in (None, "blockzoo"):
            raise ConversionError(f"{source} is a blockzoo checkpoint: give the format to convert it to (--format)")
        return get_format(format).export_checkpoint(checkpoint_directory(source), destination, **options)
    if format in (None, "blockzoo"):
        if options:
            raise ConversionError(f"options {sorted(options)} apply to exports only")
        return found.import_checkpoint(source, destination)
    target = get_format(format)
    staging = destination.parent / f".{destination.name}.native"
    if staging.exists():
        shutil.rmtree(staging)
    try:
        found.import_checkpoint(source, staging)
        return target.export_checkpoint(staging, destination, **options)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def export_adapters(source: str | Path, destination: str | Path, *, format: str | None) -> Path:
    """Write the PEFT adapters of a native fine-tuning checkpoint (or a run's latest) in `format`'s adapter files
    (Hugging Face PEFT for its formats), recording the base the checkpoint refers to, if it holds adapters only."""
    source = Path(source)
    if format in (None, "blockzoo"):
        raise ConversionError("adapters are exported to another format's adapter files: give it (--format llama, ...)")
    target = get_format(format)
    if not source.exists():
        raise CheckpointError(source, "does not exist")
    if checkpoint_format(source) is not NATIVE:
        raise ConversionError(f"{source} is no blockzoo checkpoint: only a blockzoo fine-tuning's adapters export")
    directory = checkpoint_directory(source)
    if not read_checkpoint_config(directory).get("model", {}).get("peft"):
        raise ConversionError(f"{source} is no PEFT fine-tuning (its model has no `peft`): it has no adapters")
    base = read_checkpoint_metadata(directory).get("base")
    return target.save_adapters(load(directory), Path(destination), base_model=base["path"] if base else None)


def _save_without_peft(model: LanguageModel, path: str | Path, format: str, options: dict) -> Path:
    """Save `model`, whose adapters are merged and detached, as the model without PEFT."""
    config, run_config = model.config, getattr(model, "run_config", None)
    model.config = attrs.evolve(config, peft=None)
    if run_config is not None:
        model.run_config = attrs.evolve(run_config, model=model.config)
    try:
        return save(model, path, format=format, overwrite=True, **options)
    finally:
        model.config, model.run_config = config, run_config
