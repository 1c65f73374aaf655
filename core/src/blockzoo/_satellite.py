"""Old import paths of code that moved out of the core into a distribution of its own (a satellite):
`blockzoo.ssm` is `blockzoo_ssm` (distribution blockzoo-ssm), `blockzoo.testing` is `blockzoo_testing`
(blockzoo-testing). A plugin written against plugin API 1.1 imports the old paths; they keep working wherever the
satellite is installed, and say what to install where it is not."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType


class _SubmoduleAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `old.x.y` as the module object `new.x.y` itself: one module under both names, never a second copy
    (a second copy would define every class twice and compile every kernel twice)."""

    def __init__(self, old: str, new: str):
        self.old, self.new = old, new
        self._real_specs = {}

    def find_spec(self, name, path=None, target=None):
        if not name.startswith(f"{self.old}."):
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        module = importlib.import_module(self.new + spec.name[len(self.old) :])
        # The import system writes the alias's spec on the module: exec_module puts the real one back.
        self._real_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._real_specs.pop(module.__spec__.name)


def alias_package(old: str, new: str, distribution: str) -> ModuleType:
    """Make `old` (a module of the core, run as its shim) the package `new`, submodules included; an ImportError
    naming `distribution` where it is not installed."""
    try:
        package = importlib.import_module(new)
    except ModuleNotFoundError as error:
        if error.name != new:
            raise
        raise ImportError(
            f"{old} moved to the distribution {distribution} (imported as {new}), which is not installed: "
            f"pip install {distribution}"
        ) from None
    if not any(isinstance(finder, _SubmoduleAlias) and finder.old == old for finder in sys.meta_path):
        sys.meta_path.insert(0, _SubmoduleAlias(old, new))
    sys.modules[old] = package
    return package
