"""The Python API: `blockzoo.build(config)`, `blockzoo.load(path)`, `blockzoo.save(model, path)`."""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import yaml

from blockzoo.checkpoint import (
    CHECKSUM_ALGORITHM,
    CheckpointError,
    file_checksum,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint_config,
    read_checkpoint_metadata,
    read_origin,
    save_checkpoint,
    weights_checksums,
)
from blockzoo.config import ConfigError, merge, structure, to_dict, update
from blockzoo.config import load as load_config
from blockzoo.conversion import (
    CheckpointFormat,
    ConversionError,
    Origin,
    checkpoint_formats,
    detect_format,
    get_format,
    read_json,
)
from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.parameter import uninitialized
from blockzoo.model.config import ModelConfig
from blockzoo.model.language_model import LanguageModel
from blockzoo.peft.apply import adapters, merged_weights, without_adapters
from blockzoo.plugins import get_registry
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
    distributed = distributed or Distributed(run_config.distributed)
    try:
        with uninitialized(source is not None):
            model = LanguageModel(run_config.model, distributed)
    except (RuntimeError, MemoryError):  # the allocator's words: say which fields ask for too much, as `train` does
        from blockzoo.model.size import check_fits

        check_fits(run_config, distributed, training=False)
        raise
    model.run_config = run_config
    if source is not None:
        load_pretrained_weights(model, source)
        model.origin = pretrained_origin(source)
    return model


def load(path: str | Path, *, distributed: Distributed | None = None) -> LanguageModel:
    """A model from a native checkpoint directory, a run's output directory (its latest checkpoint), or a checkpoint
    of another format a converter plugin reads (a Hugging Face directory: its format found from config.json).

    Without `distributed`, the model runs in this process alone, whatever parallel layout saved the checkpoint
    (its tensors are global); pass a `Distributed` to load it into a parallel layout.
    """
    path = Path(path)
    if (foreign := _foreign_format(path)) is not None:
        return _load_foreign(foreign, path, distributed)
    directory = _checkpoint_directory(path)
    data = read_checkpoint_config(directory)
    if distributed is None:
        alone = {"tensor_parallel": 1, "sequence_tensor_parallel": False, "pipeline_parallel": 1}
        alone |= {"pipeline_schedule": "1f1b", "pipeline_stages_per_rank": 1, "pipeline_split": None}
        alone |= {"sequence_data_parallel": 1, "micro_sequence_length": None}
        data = merge(data, {"distributed": alone})
    run_config = structure(data, RunConfig, source=str(directory / "config.yaml"))
    with uninitialized():
        model = build(run_config, distributed=distributed or Distributed(run_config.distributed, world_size=1, rank=0))
    base = read_checkpoint_metadata(directory).get("base")
    if base:  # a PEFT checkpoint holding adapters only: its base first
        load_base(model, directory, base)
    load_checkpoint(
        directory,
        model=model,
        distributed=model.distributed,
        model_source=f"the model of {directory / 'config.yaml'}",
        base_loaded=bool(base),
    )
    model.origin = read_origin(directory)
    return model


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
    foreign = _foreign_format(source)
    if foreign is None and read_checkpoint_config(_checkpoint_directory(source)).get("model", {}).get("peft"):
        return save(load(source), destination, format=format or "blockzoo", merged=True, **options)
    if merged:
        raise ConversionError(f"{source} is no PEFT fine-tuning (its model has no `peft`): there is nothing to merge")
    if foreign is None:
        if format in (None, "blockzoo"):
            raise ConversionError(f"{source} is a blockzoo checkpoint: give the format to convert it to (--format)")
        return get_format(format).export_checkpoint(_checkpoint_directory(source), destination, **options)
    if format in (None, "blockzoo"):
        if options:
            raise ConversionError(f"options {sorted(options)} apply to exports only")
        return foreign.import_checkpoint(source, destination)
    target = get_format(format)
    staging = destination.parent / f".{destination.name}.native"
    if staging.exists():
        shutil.rmtree(staging)
    try:
        foreign.import_checkpoint(source, staging)
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
    if _foreign_format(source) is not None:
        raise ConversionError(f"{source} is no blockzoo checkpoint: only a blockzoo fine-tuning's adapters export")
    directory = _checkpoint_directory(source)
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


def with_pretrained_config(run_config: RunConfig, source: str | Path) -> RunConfig:
    """`run_config` whose model is the checkpoint's at `source`, updated with the model fields `run_config` gives
    (`pretrained` consumed: None)."""
    given = to_dict(run_config.model, explicit_only=True)
    given.pop("pretrained", None)
    model = merge(pretrained_model_config(source), given)
    return update(run_config, {"model": {**model, "pretrained": None}})


def pretrained_model_config(source: str | Path) -> dict:
    """The model config (plain data) of a checkpoint of any format."""
    source = Path(source)
    if (foreign := _foreign_format(source)) is not None:
        return foreign.read_model_config(source)
    return read_checkpoint_config(_checkpoint_directory(source)).get("model", {})


def pretrained_origin(source: str | Path) -> Origin | None:
    """The origin files of a checkpoint of any format: a foreign checkpoint's own, a native one's copies."""
    source = Path(source)
    if (foreign := _foreign_format(source)) is not None:
        return foreign.origin(source)
    return read_origin(_checkpoint_directory(source))


def load_pretrained_weights(model: LanguageModel, source: str | Path, distributed: Distributed | None = None) -> None:
    """Fill `model`'s parameters (this rank's shards) from a checkpoint of any format (its base weights: the adapters
    of a fine-tuning model keep their fresh values)."""
    source, distributed = Path(source), distributed or model.distributed
    with without_adapters(model):
        if (foreign := _foreign_format(source)) is not None:
            foreign.load_weights(source, model, distributed)
        else:
            load_checkpoint(_checkpoint_directory(source), model=model, distributed=distributed)


# ---------------------------------------------------------------------------------------------------------------------
# The base of a PEFT checkpoint that holds adapters only (docs/architecture.md "Fine-tuning (LoRA)")


def base_reference(source: str | Path) -> dict[str, Any]:
    """What a PEFT checkpoint holding adapters only records of the checkpoint its frozen weights come from (its
    metadata's `base`): `path` as given, `format`, `model` (its model config, plain data) and `checksums` of its weight
    files (a native checkpoint's recorded ones; a Hugging Face directory's `*.safetensors`, hashed here)."""
    path = Path(source)
    foreign = _foreign_format(path)
    if foreign is None:
        directory = _checkpoint_directory(path)
        prefix = "" if directory == path else f"{directory.relative_to(path)}/"  # a run directory: its latest
        files = {prefix + name: digest for name, digest in weights_checksums(directory).items()}
    else:
        files = {file.name: file_checksum(file) for file in sorted(path.glob("*.safetensors"))}
    return {
        "path": str(source),
        "format": foreign.name if foreign is not None else "blockzoo",
        "model": yaml.safe_load(yaml.safe_dump(pretrained_model_config(path))),  # as the metadata will hold it
        "checksums": {"algorithm": CHECKSUM_ALGORITHM, "files": files},
    }


def check_base(checkpoint: str | Path, base: Mapping[str, Any]) -> None:
    """Raise `CheckpointError` (naming the base's path and what differs) unless the base that the checkpoint at
    `checkpoint` records (`base`, from its metadata) is still there as it was when the checkpoint was saved."""
    path = Path(base["path"])
    what = f"the base of {checkpoint} (a PEFT checkpoint holding adapters only: the frozen weights are read from it)"
    if not path.exists():
        raise CheckpointError(
            path, f"{what} does not exist (a relative path is taken from the working directory): put it back there"
        )
    found = base_reference(path)
    differences = (
        [] if found["format"] == base.get("format") else [f"format was {base.get('format')}, is {found['format']}"]
    )
    differences += _differences(_comparable(base.get("model")), _comparable(found["model"]), "model")
    recorded = (base.get("checksums") or {}).get("files") or {}
    for name in sorted(set(recorded) | set(found["checksums"]["files"])):
        now = found["checksums"]["files"].get(name)
        if name not in recorded:
            differences.append(f"{name} is new")
        elif now is None:
            differences.append(f"{name} is gone")
        elif now != recorded[name]:
            differences.append(f"{name} differs (its checksum changed)")
    if differences:
        more = f" (and {len(differences) - 5} more)" if len(differences) > 5 else ""
        raise CheckpointError(
            path,
            f"{what} changed since the checkpoint was saved: {'; '.join(differences[:5])}{more}. Adapters trained on "
            "other weights would be wrong on these: restore the base it was trained on",
        )


def _comparable(model: Any) -> Any:
    """A base's model config with every field (structured by this blockzoo), so that a field added since the
    checkpoint was saved, at its default, is no difference; as recorded if it no longer structures."""
    try:
        return to_dict(structure(model, ModelConfig, root="model"))
    except ConfigError:
        return model


def _differences(recorded: Any, found: Any, where: str) -> list[str]:
    if isinstance(recorded, Mapping) and isinstance(found, Mapping):
        return [
            difference
            for key in sorted(set(recorded) | set(found), key=str)
            for difference in _differences(recorded.get(key), found.get(key), f"{where}.{key}")
        ]
    return [] if recorded == found else [f"{where} was {recorded!r}, is {found!r}"]


def load_base(model: LanguageModel, checkpoint: str | Path, base: Mapping[str, Any], distributed=None) -> None:
    """Check the base a PEFT checkpoint holding adapters only records (`check_base`), then fill `model`'s base
    weights from it (this rank's shards); the adapters are then loaded from the checkpoint."""
    check_base(checkpoint, base)
    load_pretrained_weights(model, base["path"], distributed)


def _load_foreign(foreign: CheckpointFormat, path: Path, distributed: Distributed | None) -> LanguageModel:
    model_config = structure(foreign.read_model_config(path), ModelConfig, source=str(path), root="model")
    run_config = RunConfig(model=model_config)
    with uninitialized():
        model = build(run_config, distributed=distributed or Distributed(run_config.distributed, world_size=1, rank=0))
    foreign.load_weights(path, model, model.distributed)
    model.origin = foreign.origin(path)
    return model


def _foreign_format(path: Path) -> CheckpointFormat | None:
    """The format of a checkpoint that is not blockzoo's own (None for a native checkpoint or run directory)."""
    if (path / "metadata.yaml").is_file() or not (path / "config.json").is_file():
        return None
    found = detect_format(path)
    if found is not None:
        return found
    try:
        model_type = read_json(path / "config.json").get("model_type")
    except ConversionError:
        model_type = None
    described = f"a Hugging Face checkpoint of model_type {model_type!r}" if model_type else "a Hugging Face checkpoint"
    registry = get_registry()
    if not any(record.distribution == "blockzoo-huggingface" for record in registry.plugins.values()):
        raise CheckpointError(path, f"is {described}; importing it needs the blockzoo-huggingface plugin")
    formats = ", ".join(name for name in checkpoint_formats()) or "none"
    raise CheckpointError(
        path, f"is {described}, which no installed converter reads (blockzoo-huggingface reads: {formats})"
    )


def _checkpoint_directory(path: Path) -> Path:
    if not path.exists():
        raise CheckpointError(path, "does not exist")
    if (path / "metadata.yaml").is_file():
        return path
    # A newer checkpoint that fails verification is skipped for the one before it, and said (on stderr).
    skipped: list[str] = []

    def report(line: str) -> None:
        skipped.append(line)
        print(f"blockzoo: {line}", file=sys.stderr)

    latest = latest_checkpoint(path, report=report) if path.is_dir() else None
    if latest is None and skipped:
        count = len(skipped)
        raise CheckpointError(path, f"is a run directory, but none of its {count} checkpoints can be read (above)")
    if latest is None:
        raise CheckpointError(path, "is not a checkpoint (no metadata.yaml) nor a run directory holding checkpoints")
    return latest
