"""blockzoo: a plugin-based model zoo for training language models assembled from blocks.

`import blockzoo` is cheap: it loads no plugin and no torch. Plugins load on first use.
"""

from blockzoo.plugins import hookimpl

__version__ = "0.1.0"

__all__ = ["__version__", "hookimpl"]
