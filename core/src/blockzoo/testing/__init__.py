"""Helpers for testing blockzoo and its plugins (public: plugin authors use them too).

- The conformance kit (`blockzoo.testing.conformance`): subclass `MixerConformance` or `MLPConformance` (or
  `ConverterSectionConformance` for a checkpoint-format section) in a test module and provide `config_factory`;
  pytest runs the inherited checks.
- `run_distributed(world_size, fn, *args)` (`blockzoo.testing.distributed`): gloo ranks on the CPU.

The names load on first access: importing this package imports no torch (pytest loads `blockzoo.testing.pytest_plugin`
in every run of an environment where blockzoo is installed).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ConformanceError": "blockzoo.testing.conformance",
    "ConverterSectionConformance": "blockzoo.testing.conformance",
    "LayerConformance": "blockzoo.testing.conformance",
    "MixerConformance": "blockzoo.testing.conformance",
    "MLPConformance": "blockzoo.testing.conformance",
    "free_port": "blockzoo.testing.distributed",
    "run_distributed": "blockzoo.testing.distributed",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'blockzoo.testing' has no attribute {name!r}")
