"""A property-based config fuzzer over the schema of every installed plugin (the example plugin's included).

Valid run configs (the examples, and a tiny model per registered mixer, MLP, normalization, PEFT and dataset type,
and a pattern of blocks) are mutated: wrong scalar types, nan / inf (and the strings that float() reads as them), huge,
negative and zero numbers, wrong containers, keys that are not strings (YAML's `on`), unknown keys, missing keys,
and a polymorphic `type` swapped for another registered one (of any kind) or an unknown one. Every mutated config
must either be refused with a `ConfigError` whose every problem names a field path in words (no raw Python message),
or be accepted and then build on the meta device (no memory), or be refused there with a `ConfigError` too. Any other
exception is a traceback a user would see: the test fails with the config that caused it.

The fast test runs a fixed, derandomized number of examples; the slow one many more, printing what it found.
"""

from __future__ import annotations

import collections
import copy
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockzoo.config import ConfigError, read_yaml, structure, to_dict
from blockzoo.data.config import RandomDatasetConfig
from blockzoo.plugins import get_registry
from blockzoo.preflight import model_on_meta_device, preflight
from blockzoo.run_config import RunConfig

EXAMPLES = Path(__file__).parents[1] / "examples"
# The meta build makes every block's Python module: a mutated num_blocks of thousands is left unbuilt here (its
# parameters are counted the same way, just slowly).
MAX_BUILT_BLOCKS = 64

# Fragments of Python's own messages: a user must never read them in a config error.
RAW_PYTHON = (
    "object has no attribute",
    "object is not iterable",
    "not supported between instances",
    "unhashable type",
    "has no len()",
    "object is not subscriptable",
    "positional argument",
    "unexpected keyword argument",
    "NoneType",
    "invalid literal for",
    "could not convert",
    "index-sized integer",
    "Storage size calculation",
    "Traceback",
    "Error:",  # "TypeError: ..." inside a message: an exception's text passed through
)

TINY = {
    "model": {"hidden_size": 16, "embeddings": {"vocab_size": 64}, "decoder": {"num_blocks": 2}},
    "data": {"type": "random", "sequence_length": 16, "micro_batch_size": 2},
    "training": {"train_iters": 2},
}


def _tiny(block: dict[str, Any]) -> dict[str, Any]:
    data = copy.deepcopy(TINY)
    data["model"]["decoder"]["block"] = block
    return data


def _base_configs() -> list[dict[str, Any]]:
    """Valid run configs, as complete plain data (every field, every `type`), one or more per registered type."""
    registry = get_registry()
    # An example that starts from a pretrained checkpoint needs its files: left out.
    candidates = [
        data for path in sorted(EXAMPLES.glob("*.yaml")) if "pretrained" not in (data := read_yaml(path))["model"]
    ]
    for entry in registry.entries():
        if entry.kind == "mixer":
            candidates.append(_tiny({"mixer": {"type": entry.name}}))
        elif entry.kind == "mlp":
            candidates.append(_tiny({"mlp": {"type": entry.name}}))
        elif entry.kind == "normalization":
            candidates.append(_tiny({"normalization": {"type": entry.name}}))
        elif entry.kind == "peft":
            candidates.append({**TINY, "model": {**TINY["model"], "peft": {"type": entry.name}}})
        elif entry.kind == "dataset" and entry.name != "memmap":  # memmap needs files: its fields come with TINY's
            model = {**TINY["model"], "embeddings": {"vocab_size": 257}}  # the embedded corpus's byte ids
            data = {"type": entry.name, "sequence_length": 16}
            if entry.name == "blended":  # needs sources: two of the embedded corpus, unevenly
                stories = {"type": "embedded", "num_documents": 40}
                data["sources"] = {"a": {"weight": 2, "dataset": stories}, "b": {"weight": 0.5, "dataset": stories}}
            candidates.append({**TINY, "model": model, "data": data})
    candidates.append(
        {
            **TINY,
            "model": {
                "hidden_size": 16,
                "embeddings": {"vocab_size": 64},
                "decoder": {
                    "type": "pattern",
                    "pattern": ["a", "b", "a"],
                    "blocks": {"a": {"mixer": {"type": "attention", "heads": 2, "head_size": 8}}, "b": {}},
                },
            },
        }
    )
    bases = []
    for data in candidates:
        data = {**data, "data": {**data.get("data", {}), "type": "random"}} if _memmap(data) else data
        bases.append(to_dict(structure(data, RunConfig)))  # every base must be valid: a failure here is a bug
    return bases


def _memmap(data: dict[str, Any]) -> bool:
    return data.get("data", {}).get("type", "memmap") == "memmap"


BASES = _base_configs()
TYPE_NAMES = [*sorted({entry.name for entry in get_registry().entries()}), "acme.nope", "Attention", ""]

HOSTILE = [
    math.nan, math.inf, -math.inf, "nan", "inf", "-inf", ".nan", "NaN", "1e999",
    0, -1, 1, 2, 3, 7, 2.5, 4.0, -0.0, 1e-30, 1.0e30, -1.0e30, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1,
    10**400, True, False, None, "", "x", "on", "12", [], [1, "a"], [None], {}, {True: 1}, {1: 2, "a": 3},
    {"type": "acme.nope"}, [[1]], "model",
]  # fmt: skip


def _nodes(data: Any, path: tuple = ()) -> list[tuple]:
    """The paths of every value inside `data` (mappings by key, lists by index)."""
    found = []
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        found.append((*path, key))
        found += _nodes(value, (*path, key))
    return found


def _mappings(data: Any, path: tuple = ()) -> list[tuple]:
    found = [path] if isinstance(data, dict) else []
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        found += _mappings(value, (*path, key))
    return found


def _at(data: Any, path: tuple) -> Any:
    for step in path:
        data = data[step]
    return data


@st.composite
def mutated_configs(draw) -> dict[str, Any]:
    data = copy.deepcopy(draw(st.sampled_from(BASES)))
    for _ in range(draw(st.integers(1, 3))):
        mutation = draw(st.sampled_from(["value", "number", "unknown key", "key type", "delete", "type", "wrap"]))
        if mutation in ("unknown key", "key type", "type"):
            mapping = _at(data, draw(st.sampled_from(_mappings(data))))
            if mutation == "unknown key":
                near = [f"{key}s" for key in mapping if isinstance(key, str)]
                mapping[draw(st.sampled_from(["bogus", *near]))] = draw(st.sampled_from(HOSTILE[:20]))
            elif mutation == "key type":
                mapping[draw(st.sampled_from([True, False, 1, 0, 2.5, None]))] = draw(st.sampled_from([1, {}, "x"]))
            else:
                mapping["type"] = draw(st.sampled_from(TYPE_NAMES))
            continue
        nodes = _nodes(data)
        if not nodes:
            continue
        *parent_path, key = draw(st.sampled_from(nodes))
        parent = _at(data, tuple(parent_path))
        value = parent[key]
        if mutation == "value":
            parent[key] = copy.deepcopy(draw(st.sampled_from(HOSTILE)))
        elif mutation == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
            factor = draw(st.sampled_from([-1, 0, 2, 3, 1000, 2**20, 2**40, 0.5, 1.5]))
            parent[key] = value * factor if isinstance(factor, int) else value * factor + 0.0
        elif mutation == "delete":
            del parent[key]
        elif mutation == "wrap":
            parent[key] = draw(st.sampled_from([[value], {"x": value}, {"type": value}]))
    return data


def assert_clear(error: ConfigError) -> None:
    """Every problem names a field path and says what is wrong in words, not in Python's."""
    assert error.errors, error
    for path, message in error.errors:
        assert isinstance(path, str) and path, f"a problem without a field path: {message!r}"
        assert isinstance(message, str) and message, path
        for fragment in RAW_PYTHON:
            assert fragment not in message, f"{path}: raw Python message: {message!r}"


def fuzz_one(data: dict[str, Any]) -> str:
    """Structure, then build on the meta device; returns the outcome. Anything but a clear ConfigError fails."""
    try:
        config = structure(data, RunConfig)
    except ConfigError as error:
        assert_clear(error)
        return "refused"
    if len(config.model.decoder.expanded_blocks()) > MAX_BUILT_BLOCKS:
        return "accepted (too many blocks to build here)"
    try:
        if _cheap_data(config):  # the checks of `blockzoo config`: the model on the meta device, the data built
            preflight(config, processes=config.distributed.model_parallel)
        else:
            model_on_meta_device(config)
    except ConfigError as error:
        assert_clear(error)
        return "accepted, refused at build"
    return "accepted and built"


def _cheap_data(config: RunConfig) -> bool:
    data = config.data
    small = data.micro_batch_size * data.sequence_length <= 2**16
    return small and (isinstance(data, RandomDatasetConfig) or getattr(data, "num_documents", 0) in range(1, 10_001))


FUZZ_SETTINGS = dict(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


def test_every_base_config_builds():
    for data in BASES:
        assert fuzz_one(copy.deepcopy(data)) == "accepted and built", yaml.safe_dump(data)


@settings(max_examples=250, **FUZZ_SETTINGS)
@given(mutated_configs())
def test_mutated_configs_are_refused_clearly_or_build(data):
    fuzz_one(data)


OUTCOMES: collections.Counter = collections.Counter()


@pytest.mark.slow
@settings(max_examples=5000, **FUZZ_SETTINGS)
@given(mutated_configs())
def test_mutated_configs_many(data):
    OUTCOMES[fuzz_one(data)] += 1


@pytest.mark.slow
def test_mutated_configs_many_report(capsys):
    """Runs after the large fuzz (same module, in order): prints how many cases ended how."""
    with capsys.disabled():
        print(f"\nconfig fuzzer: {sum(OUTCOMES.values())} cases: {dict(OUTCOMES)}")
