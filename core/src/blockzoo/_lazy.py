"""Module attributes imported on first access (a module's `__getattr__`, PEP 562): what keeps `import blockzoo`,
`blockzoo.api` and `blockzoo.data` free of torch until a name that needs it is read. Torch-free."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(
    namespace: dict[str, Any], origins: Mapping[str, str], *, keep: bool = False
) -> Callable[[str], Any]:
    """The `__getattr__` of the module whose globals are `namespace`: `name` is read from the module `origins[name]`,
    imported then. `keep`: the value is stored in `namespace`, so that later reads find it there."""
    module = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        if name not in origins:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(origins[name]), name)
        if keep:
            namespace[name] = value
        return value

    return __getattr__
