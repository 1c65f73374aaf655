"""blockzoo's own checkpoints seen as a checkpoint format, so that reading a checkpoint is one path for every
format: which format a path holds (`checkpoint_format`), then that format reads it. Registered by the core's plugin
like every other format (`blockzoo.builtin`), so this module imports no torch until a checkpoint is read.

A path of the native format is a checkpoint directory (its `metadata.yaml`) or a run directory (its latest readable
checkpoint: a newer one that fails verification is skipped, and said on stderr).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from blockzoo.config import merge, structure
from blockzoo.conversion import CheckpointFormat, Origin, detect_format
from blockzoo.plugins import get_registry
from blockzoo.plugins.providers import format_provider

# A checkpoint loaded without a `Distributed` runs in this process alone, whatever layout saved it (its tensors are
# global): the layout fields, set to one process.
ONE_PROCESS_LAYOUT = {
    "tensor_parallel": 1,
    "sequence_tensor_parallel": False,
    "pipeline_parallel": 1,
    "pipeline_schedule": "1f1b",
    "pipeline_stages_per_rank": 1,
    "pipeline_split": None,
    "sequence_data_parallel": 1,
    "micro_sequence_length": None,
}


class NativeFormat(CheckpointFormat):
    """blockzoo's checkpoints (`blockzoo.checkpoint`): a checkpoint directory or a run directory."""

    name = "blockzoo"
    description = "blockzoo's own checkpoints"

    def recognizes(self, directory: Path) -> bool:
        # A directory of another format holds that format's config.json and no metadata.yaml of ours.
        return (directory / "metadata.yaml").is_file() or not (directory / "config.json").is_file()

    def origin(self, directory: Path) -> Origin | None:
        from blockzoo.checkpoint import read_origin

        return read_origin(checkpoint_directory(directory))

    def read_model_config(self, directory: Path) -> dict[str, Any]:
        from blockzoo.checkpoint import read_checkpoint_config

        return read_checkpoint_config(checkpoint_directory(directory)).get("model", {})

    def load_weights(self, directory: Path, model: Any, distributed: Any) -> None:
        from blockzoo.checkpoint import load_checkpoint

        load_checkpoint(checkpoint_directory(directory), model=model, distributed=distributed)

    def check_model_config(self, config: Any) -> None:
        """Asked before a run exports to this format (`training.export_format`): a run's checkpoints are native
        already, so there is nothing to export (and `convert` refuses native to native)."""
        from blockzoo.conversion import ConversionError

        raise ConversionError(
            "a run's checkpoints are blockzoo checkpoints already: training.export_format names another format "
            "(see `blockzoo plugins`), or leave it unset"
        )

    def save(self, model: Any, directory: Path, **options: Any) -> Path:
        from blockzoo.python_api import save

        return save(model, directory, format=self.name, **options)

    def load(self, path: Path, distributed: Any = None) -> Any:
        """The model of the checkpoint (or run's latest) at `path`, with the run config it was saved with; in this
        process alone without `distributed`. A PEFT checkpoint holding adapters only reads its base first."""
        from blockzoo.checkpoint import load_checkpoint, read_checkpoint_config, read_checkpoint_metadata, read_origin
        from blockzoo.distributed.runtime import Distributed
        from blockzoo.layers.parameter import uninitialized
        from blockzoo.model.peft_base import load_base
        from blockzoo.python_api import build
        from blockzoo.run_config import RunConfig

        directory = checkpoint_directory(path)
        data = read_checkpoint_config(directory)
        if distributed is None:
            data = merge(data, {"distributed": ONE_PROCESS_LAYOUT})
        run_config = structure(data, RunConfig, source=str(directory / "config.yaml"))
        with uninitialized():
            model = build(
                run_config, distributed=distributed or Distributed(run_config.distributed, world_size=1, rank=0)
            )
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


NATIVE = NativeFormat()


def checkpoint_format(path: Path) -> CheckpointFormat:
    """The format of the checkpoint at `path` among the registered ones (blockzoo's own first: a directory holding
    our metadata.yaml is ours, whatever else it holds). A directory that looks like another format's checkpoint
    that no installed format reads is refused, saying what to install."""
    if NATIVE.recognizes(path):
        return NATIVE
    found = detect_format(path)
    if found is not None:
        return found
    _refuse_unreadable(path)
    return NATIVE  # whose reading says what is missing


def is_native(path: Path) -> bool:
    return checkpoint_format(path) is NATIVE


def _refuse_unreadable(path: Path) -> None:
    """Raise `CheckpointError` for a checkpoint of another format that no registered format reads: what it is (as
    the plugin of its format family describes it), and which distribution reads that family."""
    from blockzoo.checkpoint import CheckpointError

    registry = get_registry()
    for entry in registry.converters:
        if isinstance(entry.section, CheckpointFormat) and (what := entry.section.describe_unread(path)):
            # The formats that plugin reads (registered as formats, not as sections of one).
            formats = ", ".join(
                sorted(
                    e.format
                    for e in registry.converters
                    if e.plugin is entry.plugin and isinstance(e.section, CheckpointFormat)
                )
            )
            reader = entry.plugin.distribution or f"plugin {entry.plugin.name}"
            raise CheckpointError(path, f"is {what}, which no installed converter reads ({reader} reads: {formats})")
    known = format_provider(path)
    if known is None:
        return
    family, distribution = known
    if not any(record.distribution == distribution for record in registry.plugins.values()):
        raise CheckpointError(path, f"is {family}; importing it needs the {distribution} plugin")
    raise CheckpointError(path, f"is {family}, which no installed converter reads ({distribution} reads: none)")


def checkpoint_directory(path: Path) -> Path:
    """The native checkpoint directory `path` names: itself, or a run directory's latest readable checkpoint."""
    from blockzoo.checkpoint import CheckpointError, latest_checkpoint

    path = Path(path)
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
