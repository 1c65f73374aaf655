"""The plugin API is documented where authors look: every public name of `blockzoo.api` has a docstring of its own and
is listed in docs/plugins/api.md, and the attributes of `Distributed` and `Batch` are named in their docstrings and
there."""

import inspect
import re
from pathlib import Path

import pytest

import blockzoo.api as api
from blockzoo.distributed.config import DistributedConfig

API_MD = (Path(__file__).parents[2] / "docs" / "plugins" / "api.md").read_text()


def _section(start: str, end: str) -> str:
    return API_MD[API_MD.index(start) : API_MD.index(end)]


def _named(text: str, called: bool = True) -> set[str]:
    """The names written in backquotes alone (`Batch`), and with `called` those called (`preprocessed(key, ...)`)."""
    return set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)" + ("[`(]" if called else "`"), text))


def test_every_public_class_and_function_has_its_own_docstring():
    undocumented = [
        name
        for name in api.__all__
        if (inspect.isclass(obj := getattr(api, name)) and not obj.__dict__.get("__doc__"))
        or (inspect.isfunction(obj) and not obj.__doc__)
    ]
    assert undocumented == []


def test_api_md_lists_exactly_the_public_names():
    listed = _named(_section("`blockzoo.api`, by purpose:", "### What a layer reads"), called=False)
    assert sorted(listed - set(api.__all__)) == [] and sorted(set(api.__all__) - listed) == []


def _public_attributes(instance) -> list[str]:
    return sorted(
        name
        for name in dir(instance)
        if not name.startswith("_") and not inspect.isroutine(getattr(type(instance), name, None))
    )


@pytest.mark.parametrize(
    "instance",
    [
        api.Distributed(DistributedConfig(backend="gloo"), world_size=1, rank=0, local_rank=0),
        api.Batch([3, 2], past_lengths=[4, 0]),
    ],
    ids=["Distributed", "Batch"],
)
def test_the_attributes_a_layer_reads_are_documented(instance):
    attributes = _public_attributes(instance)
    assert len(attributes) > 10  # the listing found them
    listed = _named(_section("### What a layer reads", "### The plugin contract"))
    docstring = _named(type(instance).__doc__)
    assert [name for name in attributes if name not in listed] == []
    assert [name for name in attributes if name not in docstring] == []
