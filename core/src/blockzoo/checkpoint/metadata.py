"""Reading a checkpoint's `metadata.yaml` (checked: its format and blockzoo versions, the plugins it needs, its
files, the config's checksum) and its `config.yaml`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from blockzoo import __version__
from blockzoo.checkpoint.checksums import CHECKSUM_ALGORITHMS, verify_checksum
from blockzoo.checkpoint.format import CONFIG_FILE, FORMAT_VERSION, METADATA_FILE, CheckpointError, read_yaml
from blockzoo.checkpoint.plugin_versions import check_plugins


def read_metadata(directory: Path) -> dict[str, Any]:
    if not directory.is_dir():
        raise CheckpointError(directory, "no such checkpoint directory")
    path = directory / METADATA_FILE
    metadata = read_yaml(path)
    required = {"format_version": int, "blockzoo_version": str, "step": int, "plugins": dict, "files": list}
    for key, kind in required.items():
        if not isinstance(metadata.get(key), kind):
            raise CheckpointError(path, f"`{key}` is missing or not a {kind.__name__}: {metadata.get(key)!r}")
    if not 1 <= metadata["format_version"] <= FORMAT_VERSION:
        raise CheckpointError(
            path,
            f"checkpoint format version {metadata['format_version']} is unknown to blockzoo {__version__} (it reads "
            f"format {FORMAT_VERSION} and older); a newer blockzoo may read it",
        )
    try:
        written_by = Version(metadata["blockzoo_version"])
    except InvalidVersion:
        raise CheckpointError(
            path, f"unknown blockzoo version {metadata['blockzoo_version']!r} (not a version number)"
        ) from None
    if written_by.major > Version(__version__).major:
        raise CheckpointError(
            path,
            f"written by blockzoo {written_by}, a newer major version than this blockzoo {__version__}; "
            "upgrade blockzoo to load it",
        )
    check_plugins(path, metadata["plugins"])
    for file in metadata["files"]:
        if not (directory / file).is_file():
            raise CheckpointError(directory / file, "missing: the checkpoint lists it but the file is not there")
    _check_checksums_entry(path, metadata)
    verify_checksum(directory / CONFIG_FILE, metadata)  # small: always (load, generate and resume refuse edits)
    return metadata


def _check_checksums_entry(path: Path, metadata: Mapping[str, Any]) -> None:
    """`checksums` (absent in checkpoints written before it) is {algorithm, files: {file: hex digest}}."""
    if "checksums" not in metadata:
        return
    checksums = metadata["checksums"]
    if not isinstance(checksums, dict) or not isinstance(checksums.get("files"), dict):
        raise CheckpointError(path, f"`checksums` is not a mapping with `algorithm` and `files`: {checksums!r}")
    if checksums.get("algorithm") not in CHECKSUM_ALGORITHMS:
        raise CheckpointError(
            path,
            f"unknown checksum algorithm {checksums.get('algorithm')!r} (this blockzoo knows "
            f"{', '.join(CHECKSUM_ALGORITHMS)})",
        )


def read_checkpoint_config(directory: str | Path) -> dict[str, Any]:
    """The run config of a checkpoint as plain data (structure it with `RunConfig`, overrides as an update)."""
    directory = Path(directory)
    read_metadata(directory)
    return read_yaml(directory / CONFIG_FILE)


def read_checkpoint_metadata(directory: str | Path) -> dict[str, Any]:
    """The metadata of a checkpoint (verified: its version, plugins, files, config checksum)."""
    return read_metadata(Path(directory))
