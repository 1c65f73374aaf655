"""Slices of sequences (sequence-data parallelism, micro-sequences): the Batch of a slice, its config checks, and
the base `Mixer.forward_slice` of a mixer that does not declare the capability."""

import itertools

import pytest
import torch

from blockzoo.config import ConfigError, structure
from blockzoo.layers.base import Batch, Mixer, SequenceData, slice_batch, slice_lengths
from blockzoo.run_config import RunConfig


def _documents_of_tokens(lengths):
    """(document, position) of every token of packed documents, by enumeration."""
    return [(document, position) for document, length in enumerate(lengths) for position in range(length)]


@pytest.mark.parametrize("lengths", [[5, 1, 6], [12], [1] * 12, [3, 3, 3, 3]])
def test_a_slice_holds_the_pieces_of_its_tokens(lengths):
    tokens = _documents_of_tokens(lengths)
    for start, stop in itertools.combinations(range(len(tokens) + 1), 2):
        batch = slice_batch(lengths, start, stop)
        expected = tokens[start:stop]
        # Pieces: the runs of tokens of one document; positions count from the document's start.
        runs = [len(list(group)) for _, group in itertools.groupby(expected, key=lambda token: token[0])]
        assert batch.lengths.tolist() == runs
        assert batch.positions.tolist() == [position for _, position in expected]
        assert batch.continued == expected[0][1]
        assert batch.is_slice and batch.sequence_data == SequenceData()
        assert batch.num_tokens == stop - start


def test_slices_are_refused_where_they_make_no_sense():
    with pytest.raises(ValueError, match=r"slice \[3, 3\) of 12 tokens"):
        slice_lengths([5, 1, 6], 3, 3)
    with pytest.raises(ValueError, match="only the first piece continues a document"):
        Batch([2, 3], past_lengths=[1, 1], sequence_data=SequenceData())
    with pytest.raises(ValueError, match="rank 0 of 1"):
        SequenceData(rank=1, size=2)
    # Generation keeps its past lengths on every sequence.
    assert not Batch([2, 3], past_lengths=[1, 1]).is_slice


def test_a_mixer_without_the_capability_refuses_slices():
    class Plain(Mixer):
        pass

    from blockzoo.testing.layers import single_process

    layer = Plain(object(), name="mixer", hidden_dim=None, distributed=single_process(), lr_scale=1.0)
    with pytest.raises(NotImplementedError, match="does not declare sequence_data_parallel"):
        layer.forward_slice(torch.zeros(2, 4), slice_batch([2], 0, 2), None)


def _run(distributed: dict, *, sequence_length: int = 16, micro_batch_size: int = 2, **sections: dict):
    data = {"type": "random", "sequence_length": sequence_length, "micro_batch_size": micro_batch_size}
    return structure({"distributed": distributed, "data": data, **sections}, RunConfig)


def test_run_configs_that_cannot_be_sliced_are_refused():
    with pytest.raises(ConfigError, match=r"data\.micro_batch_size: a micro-batch of .* = 15 tokens cannot be split"):
        _run({"sequence_data_parallel": 2}, sequence_length=15, micro_batch_size=1)
    with pytest.raises(ConfigError, match=r"distributed\.micro_sequence_length: 3 does not divide .* 16 tokens"):
        _run({"sequence_data_parallel": 2, "micro_sequence_length": 3})
    with pytest.raises(ConfigError, match=r"distributed\.sequence_tensor_parallel: each slice of 2 tokens"):
        _run({"micro_sequence_length": 2, "tensor_parallel": 4, "sequence_tensor_parallel": True})
    with pytest.raises(ConfigError, match=r"training\.compile: compiled blocks do not run slices"):
        _run({"micro_sequence_length": 4}, training={"compile": "blocks"})
    with pytest.raises(ConfigError, match="micro-sequences do not run through pipeline stages"):
        _run({"micro_sequence_length": 4, "pipeline_parallel": 2}, training={"gradient_accumulation": 2})
