"""blockzoo-wandb: tracker type `wandb`. Its config is `blockzoo_wandb.config`, the tracker `blockzoo_wandb.tracker`."""

from blockzoo_wandb.config import WandbTrackerConfig

__all__ = ["WandbTrackerConfig"]
