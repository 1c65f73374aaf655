"""blockzoo's pytest plugin (entry point `pytest11`, name `blockzoo`; disable with `-p no:blockzoo`).

pytest loads it in every run of an environment where blockzoo is installed, also for projects that have nothing
to do with blockzoo, so it changes no test by itself: it imports no torch and no plugin, adds no autouse fixture
and no option. It registers the `distributed` marker the conformance kit puts on its multi-process checks (so a
plugin project that runs pytest with `--strict-markers` accepts them), and offers fixtures:

- `blockzoo_registry`: a plugin registry discovered anew for the test and forgotten after it, for tests that
  register uninstalled plugins with `blockzoo.plugins.register_plugin`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

MARKERS = ("distributed: starts several processes (gloo ranks on the CPU; blockzoo's conformance kit)",)


def pytest_configure(config: pytest.Config) -> None:
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)


@pytest.fixture
def blockzoo_registry() -> Iterator[Any]:
    """The plugin registry, discovered anew for this test; forgotten afterwards, with whatever the test registered."""
    from blockzoo.plugins import get_registry, reset_registry

    reset_registry()
    try:
        yield get_registry(strict=False)
    finally:
        reset_registry()
