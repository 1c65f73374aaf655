"""Shared by every distribution's tests: strict plugin loading, and `gpu` tests skipped without CUDA."""

import os

import pytest

# A plugin that fails to load must fail the tests, not hide behind a lenient registry.
os.environ.setdefault("BLOCKZOO_STRICT_PLUGINS", "1")


def pytest_collection_modifyitems(config, items):
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
