"""Config of the Weights & Biases tracker (`type: wandb`). Imports neither torch nor wandb."""

from __future__ import annotations

from typing import Literal

from blockzoo.api import TrackerConfig, configclass, field


@configclass
class WandbTrackerConfig(TrackerConfig):
    """Every logged figure in a W&B run's history at its step, the run config (and parameter counts) as its config,
    the end as its exit code and `status` summary. A resumed run continues the same W&B run (its id is kept in
    `<output_dir>/trackers/<name>.json`), or a new one superseding it when an earlier process had sent steps past the
    checkpoint (docs/tracking.md)."""

    project: str = field("blockzoo", doc="The W&B project.")
    entity: str | None = field(None, doc="The W&B entity (user or team); None: the default of the logged-in user.")
    name: str | None = field(None, doc="The W&B run's display name; None: the output directory's name.")
    mode: Literal["online", "offline", "disabled"] = field(
        "online",
        doc="`online`: sent as the run goes (needs `wandb login` or WANDB_API_KEY); `offline`: written under `dir` "
        "only, for `wandb sync` later; `disabled`: nothing.",
    )
    tags: list[str] = field(factory=list, doc="Tags of the W&B run.")
    group: str | None = field(None, doc="The W&B group the run belongs to (runs compared together).")
    dir: str | None = field(None, doc="Where wandb keeps its files (its `wandb/` folder); None: the output directory.")
    separate_process: bool = field(
        True,
        doc="Run the tracker in a child process of its own (the default here): its library's work never holds the "
        "training loop's interpreter. false: on a thread of the training process.",
    )
