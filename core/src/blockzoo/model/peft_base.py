"""The base of a PEFT checkpoint that holds adapters only (docs/architecture.md "Fine-tuning (LoRA)"): what such a
checkpoint records of the checkpoint its frozen weights come from, and the check that it is still there as it was."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from blockzoo.checkpoint import (
    CHECKSUM_ALGORITHM,
    CHECKSUM_ALGORITHMS,
    CheckpointError,
    file_checksum,
    weights_checksums,
)
from blockzoo.config import ConfigError, structure, to_dict
from blockzoo.model.config import ModelConfig
from blockzoo.model.native import NATIVE, checkpoint_directory, checkpoint_format
from blockzoo.model.pretrained import load_pretrained_weights, pretrained_model_config


def base_reference(source: str | Path, algorithm: str = CHECKSUM_ALGORITHM) -> dict[str, Any]:
    """What a PEFT checkpoint holding adapters only records of the checkpoint its frozen weights come from (its
    metadata's `base`): `path` as given, `format`, `model` (its model config, plain data) and `checksums` of its weight
    files by `algorithm` (a native checkpoint's recorded ones; another format's `*.safetensors`, hashed here)."""
    path = Path(source)
    found_format = checkpoint_format(path)
    if found_format is NATIVE:
        directory = checkpoint_directory(path)
        prefix = "" if directory == path else f"{directory.relative_to(path)}/"  # a run directory: its latest
        files = {prefix + name: digest for name, digest in weights_checksums(directory, algorithm).items()}
    else:
        files = {file.name: file_checksum(file, algorithm=algorithm) for file in sorted(path.glob("*.safetensors"))}
    return {
        "path": str(source),
        "format": found_format.name,
        "model": yaml.safe_load(yaml.safe_dump(pretrained_model_config(path))),  # as the metadata will hold it
        "checksums": {"algorithm": algorithm, "files": files},
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
    algorithm = (base.get("checksums") or {}).get("algorithm", CHECKSUM_ALGORITHM)
    if algorithm not in CHECKSUM_ALGORITHMS:
        raise CheckpointError(checkpoint, f"records its base's checksums by an unknown algorithm {algorithm!r}")
    found = base_reference(path, algorithm)
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


def load_base(model: Any, checkpoint: str | Path, base: Mapping[str, Any], distributed=None) -> None:
    """Check the base a PEFT checkpoint holding adapters only records (`check_base`), then fill `model`'s base
    weights from it (this rank's shards); the adapters are then loaded from the checkpoint."""
    check_base(checkpoint, base)
    load_pretrained_weights(model, base["path"], distributed)
