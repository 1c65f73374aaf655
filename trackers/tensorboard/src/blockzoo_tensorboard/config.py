"""Config of the TensorBoard tracker (`type: tensorboard`). Imports neither torch nor tensorboard."""

from __future__ import annotations

from blockzoo.api import TrackerConfig, configclass, field, greater_than


@configclass
class TensorBoardTrackerConfig(TrackerConfig):
    """Every logged figure as a TensorBoard scalar at its step (`source_tokens/web`, ...), the run's config and
    parameter counts as text. A resumed run writes to the same directory and supersedes the steps after its checkpoint
    that an earlier process had logged (TensorBoard's purge of a restarted run)."""

    log_dir: str | None = field(None, doc="Where the event files go; None: `<output_dir>/tensorboard`.")
    flush_seconds: float = field(
        10.0, doc="How often the event files are flushed to disk (seconds).", validator=greater_than(0)
    )
    separate_process: bool = field(
        True,
        doc="Run the tracker in a child process of its own (the default here): its library's work never holds the "
        "training loop's interpreter. false: on a thread of the training process.",
    )
