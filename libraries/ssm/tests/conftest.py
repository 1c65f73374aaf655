import pytest


@pytest.fixture
def ssm_registry(monkeypatch):
    """A registry of the core's plugin and this distribution's (`ssm`) only, whatever else is installed."""
    from blockzoo import plugins

    monkeypatch.setattr(plugins, "_registry", plugins.discover({"BLOCKZOO_PLUGINS": "ssm"}))


@pytest.fixture
def core_only_registry(monkeypatch):
    """A registry of the core's own plugin only: blockzoo-ssm as if it were not installed."""
    from blockzoo import plugins

    monkeypatch.setattr(plugins, "_registry", plugins.discover({"BLOCKZOO_PLUGINS": ""}))
