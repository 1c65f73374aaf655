"""Configs of the trackers, where a run's figures go (`training.trackers`). Torch-free, like every config.

`training.trackers` maps names to tracker configs, merged over `{jsonl: {type: jsonl}}`: the core's `metrics.jsonl`
stays on when a user adds others, and `jsonl: null` turns it off (any name set to null is removed). Other types
(`tensorboard`, `wandb`, `mlflow`, a third party's `<plugin>.<name>`) come from their plugins (docs/tracking.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from blockzoo.config import PolymorphicConfig, configclass, field

DEFAULT_TRACKER = "jsonl"

SEPARATE_PROCESS_DOC = (
    "Run the tracker in a child process of its own, not on a thread of the training process: its work then never "
    "holds the training loop's interpreter (the loop's cost is a queue put, the tracker thread's a pipe write of "
    "the entry). Costs the child's start (an interpreter, the tracker's library) once."
)


@configclass
class TrackerConfig(PolymorphicConfig):
    """Where a run's figures go: its start (the resolved config, the parameter counts), every logged step's figures,
    its end (finished, failed, interrupted). Written by rank 0 only."""

    kind: ClassVar[str] = "tracker"
    default_type: ClassVar[str] = "jsonl"

    separate_process: bool = field(False, doc=SEPARATE_PROCESS_DOC)


@configclass
class JsonlTrackerConfig(TrackerConfig):
    """`<output_dir>/metrics.jsonl`: one JSON object per logged step, what `blockzoo plot` draws. A resumed run
    drops the lines of the steps it trains again."""


def active_trackers(trackers: Mapping[str, TrackerConfig | None]) -> dict[str, TrackerConfig]:
    """The trackers a run writes to: `trackers` over the default `{jsonl: {type: jsonl}}`, names set to None left
    out."""
    merged: dict[str, TrackerConfig | None] = {DEFAULT_TRACKER: JsonlTrackerConfig(), **trackers}
    return {name: config for name, config in merged.items() if config is not None}
