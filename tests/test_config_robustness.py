"""Hostile configs: every bad input is a `ConfigError` naming the field and what was expected,
and through the `blockzoo` command exit code 2 without a traceback.

1. keys that are not strings (YAML reads `on`/`off`/`yes`/`no` as booleans, `1` as an int);
2. nan / inf (and the strings float() reads as them) refused by every float field that does not document otherwise;
3. integers are 64-bit integers (a float only when it is a whole number a float holds exactly); sizes the device
   cannot hold refused before allocating; counts with a bound say so;
4. a wrong container says what was expected;
5. `blockzoo config` runs the checks that need neither the data read nor the ranks started, and says what it skipped.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import typing
from pathlib import Path

import attrs
import pytest
import torch
import yaml

from blockzoo.config import ConfigError, read_yaml, structure
from blockzoo.model import size
from blockzoo.model.size import check_fits
from blockzoo.plugins import get_registry
from blockzoo.run_config import RunConfig
from blockzoo.schema import _hints, _plain_configs
from blockzoo_testing.layers import single_process

EXAMPLES = Path(__file__).parents[1] / "examples"
TINY = {
    "model": {"hidden_size": 16, "embeddings": {"vocab_size": 257}, "decoder": {"num_blocks": 2}},
    "data": {"type": "embedded", "num_documents": 40, "sequence_length": 16, "micro_batch_size": 2},
}


def errors_of(data, cls=RunConfig) -> dict[str, str]:
    with pytest.raises(ConfigError) as caught:
        structure(data, cls)
    return dict(caught.value.errors)


def blockzoo(*arguments) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "blockzoo", *map(str, arguments)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONIOENCODING": "utf-8"},
        timeout=180,
    )


def assert_usage_error(result: subprocess.CompletedProcess, *expected: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    for text in expected:
        assert text in result.stderr, f"{text!r} not in: {result.stderr}"


@pytest.fixture
def tiny_file(tmp_path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**TINY, "training": {"output_dir": str(tmp_path / "run"), "train_iters": 1}}))
    return path


# -- 1. keys that are not strings ------------------------------------------------------------------------------------


def test_keys_that_are_not_strings_are_named_with_their_place():
    errors = errors_of(yaml.safe_load("model: {on: 1, hidden_size: 8}"))
    assert errors["model.True"] == (
        "the key True (bool) is not a string: YAML reads an unquoted on/yes/true as true; quote the key (e.g. 'on')"
    )
    errors = errors_of(yaml.safe_load("model: {embeddings: {1: 2, vocab_size: 3, no: 4}}"))
    assert "unquoted off/no/false as false; quote the key (e.g. 'off')" in errors["model.embeddings.False"]
    assert errors["model.embeddings.1"].startswith("the key 1 (int) is not a string")
    # In a mapping field (named blocks, recompute_blocks) too, and mixed with string keys (no sorting crash).
    pattern = "{type: pattern, pattern: [a], blocks: {a: {}, yes: {}, 2: {}}}"
    errors = errors_of(yaml.safe_load(f"model: {{decoder: {pattern}}}\ntraining: {{recompute_blocks: {{1: full}}}}"))
    assert set(errors) >= {"model.decoder.blocks.True", "model.decoder.blocks.2", "training.recompute_blocks.1"}


def test_a_boolean_key_is_a_usage_error_on_the_command_line(tiny_file):
    tiny_file.write_text(tiny_file.read_text() + "distributed: {on: 1}\n")
    assert_usage_error(blockzoo("config", tiny_file), "distributed.True", "quote the key")


# -- 2. non-finite numbers ---------------------------------------------------------------------------------------------


def _config_classes() -> list[type]:
    entries = get_registry().entries()
    return sorted(
        set(_plain_configs([RunConfig, *(entry.config_class for entry in entries)]))
        | {entry.config_class for entry in entries},
        key=lambda cls: cls.__qualname__,
    )


def _float_fields() -> list[tuple[type, attrs.Attribute, typing.Any]]:
    """(class, field, annotation) of every field of every installed config class that holds floats."""
    found = []
    for cls in _config_classes():
        hints = _hints(cls)
        for attribute in attrs.fields(cls):
            annotation = hints.get(attribute.name, attribute.type)
            if float in (annotation, *typing.get_args(annotation)):
                found.append((cls, attribute, annotation))
    return found


FLOAT_FIELDS = _float_fields()
NON_FINITE = [math.nan, math.inf, -math.inf, "nan", "inf", "-inf", "NaN", "1e999"]


def test_the_float_fields_are_found():
    names = {f"{cls.__name__}.{attribute.name}" for cls, attribute, _ in FLOAT_FIELDS}
    assert {"AdamWConfig.learning_rate", "TrainingConfig.gradient_clipping", "Mamba2Config.dt_limit"} <= names
    assert len(FLOAT_FIELDS) > 30


@pytest.mark.parametrize(("cls", "attribute", "annotation"), FLOAT_FIELDS, ids=lambda x: getattr(x, "__name__", ""))
def test_every_float_field_refuses_non_finite_numbers(cls, attribute, annotation):
    is_pair, is_mapping = typing.get_origin(annotation) is tuple, typing.get_origin(annotation) is dict
    for value in NON_FINITE:
        data = {attribute.name: [0.0, value] if is_pair else {"a": value} if is_mapping else value}
        try:
            structure(data, cls)
        except ConfigError as error:  # the field's own problem (a class with required fields names them too)
            path, message = next(((p, m) for p, m in error.errors if p.startswith(attribute.name)), error.errors[0])
            assert path.startswith(attribute.name), error
            assert "finite" in message or "not a number" in message or "too large" in message or "must" in message
            continue
        # Only a field that documents it takes infinity; NaN never.
        assert attribute.metadata.get("infinite") and "inf" in attribute.metadata["doc"], (cls, attribute.name, value)
        assert not (isinstance(value, float) and math.isnan(value)) and value not in ("nan", "NaN")


def test_non_finite_values_from_the_command_line_are_refused(tiny_file):
    result = blockzoo("config", tiny_file, "training.gradient_clipping=.nan", "training.optimizer.learning_rate=inf")
    assert_usage_error(result, "training.gradient_clipping: expected a number, got nan (not a number)")
    assert "training.optimizer.learning_rate: expected a finite number, got 'inf'" in result.stderr


# -- 3. integers and sizes ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "path", "message"),
    [
        ({"model": {"decoder": {"num_blocks": 1.0e30}}}, "model.decoder.num_blocks", "expected an integer, got 1e+30"),
        ({"model": {"decoder": {"num_blocks": 2.5}}}, "model.decoder.num_blocks", "expected an integer, got 2.5"),
        ({"model": {"decoder": {"num_blocks": 100_000}}}, "model.decoder.num_blocks", "must be <= 10000"),
        ({"model": {"embeddings": {"vocab_size": 2**63}}}, "model.embeddings.vocab_size", "does not fit in 64 bits"),
        ({"distributed": {"seed": 2**64}}, "distributed.seed", "does not fit in 64 bits"),
        ({"distributed": {"seed": 1.0e30}}, "distributed.seed", "expected an integer"),
        ({"training": {"evaluation": {"iters": 1.0e30}}}, "training.evaluation.iters", "expected an integer"),
        ({"data": {"num_documents": 10**9}}, "data.num_documents", "must be <= 1000000"),
        ({"model": {"hidden_size": 10**400}}, "model.hidden_size", "a 401-digit integer does not fit in 64 bits"),
        (
            {"model": {"decoder": {"block": {"mixer": {"type": "attention", "window_size": 1.0e30}}}}},
            "model.decoder.block.mixer.window_size",
            "expected an integer",
        ),
    ],
)
def test_integers_are_64_bit_integers(override, path, message):
    from blockzoo.config import merge

    errors = errors_of(merge(TINY, override))
    assert message in errors[path], errors


def test_a_whole_float_is_taken_as_that_integer_and_a_64_bit_seed_is_one_torch_takes():
    from blockzoo.config import merge

    data = merge(TINY, {"model": {"decoder": {"num_blocks": 4.0}}, "distributed": {"seed": 2**63 - 1}})
    config = structure(data, RunConfig)
    assert config.model.decoder.num_blocks == 4 and type(config.model.decoder.num_blocks) is int
    torch.manual_seed(config.distributed.seed)  # the largest seed the config takes, within torch's range
    assert torch.initial_seed() == 2**63 - 1


def test_check_fits_counts_the_parameters_of_the_built_model(monkeypatch):
    config = structure(TINY, RunConfig)
    distributed = single_process()
    from blockzoo.model.language_model import LanguageModel

    built = LanguageModel(config.model, distributed)
    expected = sum(parameter.numel() * parameter.element_size() for parameter in built.parameters())
    assert check_fits(config, distributed) == expected
    monkeypatch.setattr(size, "device_memory", lambda device: expected - 1)
    with pytest.raises(ConfigError) as caught:
        check_fits(config, distributed, training=False)
    assert caught.value.errors[0][0] == "model" and "parameters alone take" in caught.value.errors[0][1]


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("model.hidden_size=2147483648", ["model: its parameters alone take", "GiB", "more than this machine"]),
        (
            "model.embeddings.vocab_size=4611686018427387904",
            ["model: cannot be built: parameter 'embeddings.word_embeddings'", "more than 2**63 - 1 bytes"],
        ),
        ("data.micro_batch_size=1000000000", ["data.micro_batch_size: a micro-batch of", "more than this machine"]),
        ("training.gradient_accumulation=100000000000", ["training.gradient_accumulation: a step's 100000000000"]),
    ],
)
def test_train_refuses_what_the_device_cannot_hold_before_allocating(tiny_file, override, expected):
    assert_usage_error(blockzoo("train", tiny_file, override), *expected)


def test_found_by_the_fuzzer_random_documents_longer_than_the_sequence():
    # Once a RuntimeError of torch.randint when the first batch was drawn.
    data = {**TINY, "data": {"type": "random", "sequence_length": 16, "min_document_length": 1000}}
    assert "must be <= the longest document" in errors_of(data)["data.min_document_length"]


def test_found_by_the_fuzzer_a_parameter_whose_bytes_overflow():
    # Fewer than 2**63 elements, but more bytes: once torch's "Storage size calculation overflowed".
    from blockzoo.config import merge
    from blockzoo.preflight import model_on_meta_device

    config = structure(merge(TINY, {"model": {"embeddings": {"vocab_size": 2**53 + 1}, "hidden_size": 768}}), RunConfig)
    with pytest.raises(ConfigError) as caught:
        model_on_meta_device(config)
    path, message = caught.value.errors[0]
    assert path == "model" and "parameter 'embeddings.word_embeddings' of shape [9007199254740993, 768]" in message


def test_found_by_the_fuzzer_a_plugin_layer_is_not_blamed_for_a_parameter_the_config_makes_impossible():
    # Once "the mlp 'mlp' of plugin 'mlp' ... failed while building: ValueError: ..." (the engine's check, a raw type).
    from blockzoo.config import merge
    from blockzoo.preflight import model_on_meta_device

    config = structure(
        merge(TINY, {"model": {"decoder": {"block": {"mlp": {"intermediate_size": 2**61 + 1}}}}}), RunConfig
    )
    with pytest.raises(ConfigError) as caught:
        model_on_meta_device(config)
    path, message = caught.value.errors[0]
    assert path == "model" and message.startswith("cannot be built: parameter 'decoder.0.mlp.")
    assert "more than 2**63 - 1 bytes" in message and "Error" not in message and "plugin" not in message


# -- 4. wrong containers -----------------------------------------------------------------------------------------------


def test_a_wrong_container_says_what_was_expected():
    hybrid = read_yaml(EXAMPLES / "hybrid.yaml")

    def decoder_errors(**changes):
        return errors_of({**hybrid, "model": {**hybrid["model"], "decoder": {**hybrid["model"]["decoder"], **changes}}})

    assert decoder_errors(blocks=1)["model.decoder.blocks"] == (
        "expected a mapping of names to block configs (mappings), got 1 (int)"
    )
    assert decoder_errors(pattern=3)["model.decoder.pattern"] == "expected a list of strings, got 3 (int)"
    assert decoder_errors(pattern="ssm")["model.decoder.pattern"] == "expected a list of strings, got 'ssm' (str)"
    mamba = {"type": "mamba_2", "dt_limit": 1}
    errors = errors_of({"model": {"decoder": {"block": {"mixer": mamba}}}, "distributed": {"pipeline_split": 3}})
    assert errors["model.decoder.block.mixer.dt_limit"] == "expected a list of 2 numbers, got 1 (int)"
    assert errors["distributed.pipeline_split"] == "expected a list of integers, got 3 (int)"
    errors = errors_of({"training": {"recompute_blocks": ["full"]}, "model": {"decoder": {"block": 7}}})
    assert errors["training.recompute_blocks"].startswith("expected a mapping of names to values among 'none'")
    assert errors["model.decoder.block"] == "expected a mapping for a block config, got 7 (int)"


def test_a_wrong_container_is_a_usage_error_on_the_command_line():
    result = blockzoo("config", EXAMPLES / "hybrid.yaml", "model.decoder.blocks=1", "model.decoder.pattern=3")
    assert_usage_error(result, "model.decoder.blocks: expected a mapping of names to block configs")
    assert "model.decoder.pattern: expected a list of strings, got 3 (int)" in result.stderr
    assert "object" not in result.stderr


# -- 5. blockzoo config runs the checks of a run short of the data and the ranks -------------------------------------


def test_config_refuses_what_train_would_refuse_before_its_first_step(tiny_file, tmp_path):
    memmap = "data={type: memmap, sequence_length: 16}"
    assert_usage_error(blockzoo("config", tiny_file, memmap), "data.path: the memmap dataset needs a path")
    assert_usage_error(
        blockzoo("config", tiny_file, "data.sequence_length=100000"),
        "data: the training split of the embedded corpus holds",
        "fewer than one sequence of 100000",
    )
    result = blockzoo("config", tiny_file, "distributed.tensor_parallel=2", "model.decoder.block.mixer.heads=2")
    assert_usage_error(result, "distributed: this layout needs a multiple of", "torchrun --nproc-per-node 2")
    passed = blockzoo(
        "config", tiny_file, "distributed.tensor_parallel=2", "model.decoder.block.mixer.heads=2", "--processes", 2
    )
    assert passed.returncode == 0, passed.stderr
    assert (
        "checked: the layout of 2 process(es): 2 tensor-parallel × 1 sequence-data-parallel × 1 data-parallel × "
        "1 pipeline stage" in passed.stderr
    )
    assert "the model, built on the meta device" in passed.stderr
    assert "not checked (needs the data read or the ranks started):" in passed.stderr
    assert "each rank's part of the model" in passed.stderr
    assert structure(yaml.safe_load(passed.stdout), RunConfig).distributed.tensor_parallel == 2
