import pytest

from blockzoo.plugins import reset_registry


@pytest.fixture
def fresh_registry():
    """A registry discovered anew, forgotten after the test (for tests that register in-process plugins)."""
    reset_registry()
    yield
    reset_registry()
