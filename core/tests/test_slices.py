"""Slices of sequences (sequence-data parallelism, micro-sequences): the Batch of a slice, the run-config checks, the
base `Mixer.forward_slice` of a mixer that does not declare the capability, which tokens each rank runs and places,
and the named losses of a micro-batch run as slices. Core alone: the models are made of `none` parts."""

import itertools
import types
from typing import ClassVar

import pytest
import torch

from blockzoo.api import SEQUENCE_DATA_PARALLEL, MixerConfig, check, configclass, field, hookimpl
from blockzoo.config import ConfigError, structure
from blockzoo.data.dataset import MicroBatch, Sample
from blockzoo.distributed.config import DistributedConfig
from blockzoo.layers.base import Batch, Mixer, SequenceData, slice_batch, slice_lengths, slice_losses
from blockzoo.plugins import register_plugin
from blockzoo.run_config import RunConfig
from blockzoo.training.step import own_slices, place_micro_batch


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

    from blockzoo_testing.layers import single_process

    layer = Plain(object(), name="mixer", hidden_dim=None, distributed=single_process(), lr_scale=1.0)
    with pytest.raises(NotImplementedError, match="does not declare sequence_data_parallel"):
        layer.forward_slice(torch.zeros(2, 4), slice_batch([2], 0, 2), None)


# A block the core alone can build (the default mixer and MLP types come from plugins).
EMPTY_BLOCK = {"mixer": {"type": "none"}, "mlp": {"type": "none"}}


@configclass
class SequentialMixerConfig(MixerConfig):
    """A mixer type that cannot run slices of sequences (it declares nothing)."""


@configclass
class RefusingMixerConfig(MixerConfig):
    """Declares sequence_data_parallel, but not with `unsliceable` set."""

    capabilities: ClassVar[frozenset[str]] = frozenset({SEQUENCE_DATA_PARALLEL})
    unsliceable: bool = field(False, doc="Refused over slices.")

    def check_sequence_data_parallel(self) -> None:
        check(not self.unsliceable, "unsliceable", "cannot run over slices")


@hookimpl
def _register_mixers(register):
    register("demo.sequential", SequentialMixerConfig)
    register("demo.refusing", RefusingMixerConfig)


@pytest.fixture
def demo_plugin(fresh_registry):
    register_plugin(types.SimpleNamespace(register_mixers=_register_mixers), "demo")


def _run(distributed: dict, *, sequence_length: int = 16, micro_batch_size: int = 2, mixer: dict | None = None, **more):
    data = {"type": "random", "sequence_length": sequence_length, "micro_batch_size": micro_batch_size}
    model = {"hidden_size": 16, "decoder": {"block": {**EMPTY_BLOCK, "mixer": mixer or {"type": "none"}}}}
    return structure({"model": model, "distributed": distributed, "data": data, **more}, RunConfig)


def test_run_configs_that_cannot_be_sliced_are_refused(demo_plugin):
    assert _run({"sequence_data_parallel": 2, "micro_sequence_length": 4}).distributed.uses_slices
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
    # A layer without the capability, named with the setting that needs it; a layer's own refusal, with its field.
    sequential = {"type": "demo.sequential"}
    with pytest.raises(ConfigError, match=r"mixer type 'demo.sequential' does not support sequence-data-parallel"):
        _run({"sequence_data_parallel": 2}, mixer=sequential)
    with pytest.raises(ConfigError, match=r"\(distributed\.micro_sequence_length\)"):
        _run({"micro_sequence_length": 8}, mixer=sequential)
    assert _run({}, mixer=sequential).distributed.micro_sequence_length is None
    with pytest.raises(ConfigError, match=r"model\.decoder\.block\.mixer\.unsliceable: cannot run over slices"):
        _run({"micro_sequence_length": 8}, mixer={"type": "demo.refusing", "unsliceable": True})
    _run({"micro_sequence_length": 8}, mixer={"type": "demo.refusing"})


GROUP = types.SimpleNamespace(name="the sequence-data group")  # placing slices only names it


def _layout(ranks: int, rank: int, micro_sequence_length: int | None) -> types.SimpleNamespace:
    """What placing a micro-batch reads of a `Distributed`, for rank `rank` of `ranks` sequence-data ranks."""
    config = DistributedConfig(sequence_data_parallel=ranks, micro_sequence_length=micro_sequence_length)
    group = GROUP if ranks > 1 else None
    return types.SimpleNamespace(
        config=config,
        device=torch.device("cpu"),
        sequence_data_rank=rank,
        sequence_data_size=ranks,
        sequence_data_group=group,
    )


@pytest.mark.parametrize(("ranks", "length"), [(1, 4), (2, None), (2, 4), (4, 2), (4, None)])
def test_the_ranks_slices_cover_the_micro_batch_once_in_steps_of_consecutive_tokens(ranks, length):
    tokens = 16
    placed = {rank: own_slices(tokens, _layout(ranks, rank, length)) for rank in range(ranks)}
    chunk = length or tokens // ranks
    for ranges in placed.values():
        assert all(stop - start == chunk for start, stop in ranges)
    # Step c: the ranks' chunks are consecutive, in rank order.
    steps = list(zip(*placed.values()))
    assert [start for step in steps for start, _ in step] == list(range(0, tokens, chunk))


def test_a_rank_places_its_slices_tokens_labels_and_batches():
    micro = MicroBatch.pack([Sample(torch.arange(10, 26), [5, 1, 6, 4])])
    layout = _layout(2, 1, 4)  # rank 1 of 2, chunks of 4: tokens 4:8 and 12:16
    placed = place_micro_batch(micro, layout)
    assert placed.tokens.tolist() == [*range(14, 18), *range(22, 26)]
    assert placed.labels.tolist() == micro.labels[4:8].tolist() + micro.labels[12:16].tolist()
    first, second = placed.batch
    assert first.lengths.tolist() == [1, 1, 2] and first.continued == 4  # the end of 5, then 1, then 6's start
    assert second.lengths.tolist() == [4] and second.continued == 0
    assert first.sequence_data == SequenceData(group=GROUP, rank=1, size=2)
    assert first.positions.tolist() == [4, 0, 0, 1]
    # Without slices the whole micro-batch, one Batch.
    whole = place_micro_batch(micro, _layout(1, 0, None))
    assert torch.equal(whole.tokens, micro.tokens) and not whole.batch.is_slice


def test_statistics_losses_cover_every_slice():
    def mean(statistics):
        return statistics["sum"] / statistics["count"]

    values = torch.arange(12.0, requires_grad=True)
    whole = Batch([12])
    whole.add_statistics_loss("mean", {"sum": values.sum(), "count": torch.tensor(12.0)}, mean)
    slices = [slice_batch([12], start, start + 4) for start in (0, 4, 8)]
    for batch in slices:
        part = values[batch.positions]
        batch.add_statistics_loss("mean", {"sum": part.sum(), "count": torch.tensor(4.0)}, mean)
        batch.add_loss("sum", part.sum())
    losses = slice_losses(slices)
    torch.testing.assert_close(losses["mean"], whole.losses["mean"])
    torch.testing.assert_close(losses["sum"], values.sum())
    (grad,) = torch.autograd.grad(losses["mean"], values)
    torch.testing.assert_close(grad, torch.full((12,), 1 / 12))
    with pytest.raises(ValueError, match="two layers add a loss named 'mean'"):
        slices[0].add_loss("mean", values.sum())
    missing = slice_batch([12], 0, 4)
    with pytest.raises(
        ValueError, match="the loss 'sum' was added by the first slice of a micro-batch, not by slice 1"
    ):
        slice_losses([slices[0], missing])
