"""blockzoo-tensorboard: tracker type `tensorboard`. Its config is `blockzoo_tensorboard.config`, the tracker
`blockzoo_tensorboard.tracker`."""

from blockzoo_tensorboard.config import TensorBoardTrackerConfig

__all__ = ["TensorBoardTrackerConfig"]
