"""blockzoo-mlflow: tracker type `mlflow`. Its config is `blockzoo_mlflow.config`, the tracker
`blockzoo_mlflow.tracker`."""

from blockzoo_mlflow.config import MLflowTrackerConfig

__all__ = ["MLflowTrackerConfig"]
