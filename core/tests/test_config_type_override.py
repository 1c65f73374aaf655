"""An update that gives a part another `type` keeps the part's explicit fields that the new type
also has (the new type's defaults for the rest, the old type's other keys dropped), at any depth."""

import pytest

from blockzoo import config
from blockzoo.config import ConfigError
from blockzoo.data.config import EmbeddedDatasetConfig, MemmapDatasetConfig, RandomDatasetConfig
from blockzoo.run_config import RunConfig

# The block is one the core alone builds (the default mixer and MLP types come from plugins): tests(blockzoo) runs this.
FILE = {
    "model": {
        "hidden_size": 32,
        "embeddings": {"vocab_size": 257},
        "decoder": {"block": {"mixer": {"type": "none"}, "mlp": {"type": "none"}}},
    },
    "data": {"type": "embedded", "sequence_length": 256, "micro_batch_size": 8, "num_documents": 50},
}


def test_changing_the_data_type_keeps_the_fields_both_types_have():
    run = config.load(RunConfig, data=FILE, overrides=["data.type=memmap", "data.path=tokens"])
    # sequence_length and micro_batch_size carried; num_documents (not a memmap field) dropped; the rest defaults.
    assert run.data == MemmapDatasetConfig(sequence_length=256, micro_batch_size=8, path="tokens")
    assert run.data.explicit_fields() == {"sequence_length", "micro_batch_size", "path"}


def test_the_overrides_win_and_only_explicit_fields_are_carried():
    base = {**FILE, "data": {**FILE["data"], "validation_fraction": 0.2}}
    run = config.load(RunConfig, data=base, overrides=["data.type=memmap", "data.sequence_length=64"])
    assert (run.data.sequence_length, run.data.micro_batch_size, run.data.validation_fraction) == (64, 8, 0.2)
    # The embedded type's default validation_fraction (0.05) is not explicit: memmap's own default (0) applies.
    run = config.load(RunConfig, data=FILE, overrides=["data.type=memmap"])
    assert run.data.validation_fraction == MemmapDatasetConfig().validation_fraction == 0.0
    assert EmbeddedDatasetConfig().validation_fraction != 0.0


def test_the_same_type_merges_and_a_direct_update_carries_too():
    run = config.load(RunConfig, data=FILE, overrides=["data.type=embedded", "data.micro_batch_size=2"])
    assert run.data == EmbeddedDatasetConfig(sequence_length=256, micro_batch_size=2, num_documents=50)
    updated = config.update(run, {"data": {"type": "random"}})
    assert updated.data == RandomDatasetConfig(sequence_length=256, micro_batch_size=2)


def test_an_unknown_new_type_is_still_named_at_its_field():
    with pytest.raises(ConfigError) as caught:
        config.load(RunConfig, data=FILE, overrides=["data.type=parquet"])
    ((path, message),) = caught.value.errors
    assert path == "data.type" and "unknown dataset type 'parquet'" in message
