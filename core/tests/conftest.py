import pytest

from blockzoo.plugins import reset_registry


@pytest.fixture
def fresh_registry():
    """A registry discovered anew, forgotten after the test (for tests that register in-process plugins)."""
    reset_registry()
    yield
    reset_registry()


@pytest.fixture
def core_only_registry(monkeypatch):
    """A registry of the core's own plugin only, whatever else is installed."""
    from blockzoo import plugins

    monkeypatch.setattr(plugins, "_registry", plugins.discover({"BLOCKZOO_PLUGINS": ""}))
