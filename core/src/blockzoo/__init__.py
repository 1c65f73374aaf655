"""blockzoo: a plugin-based model zoo for training language models assembled from blocks.

`import blockzoo` is cheap: it loads no plugin and no torch. Plugins load on first use, and the
Python API (`build`, `load`, `save`) imports torch when first used.
"""

import importlib
from typing import Any

from blockzoo.plugins import hookimpl

__version__ = "0.1.0"

_API = {"build": "blockzoo.model.factory", "load": "blockzoo.model.factory", "save": "blockzoo.model.factory"}

__all__ = ["__version__", "build", "hookimpl", "load", "save"]


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'blockzoo' has no attribute {name!r}")
