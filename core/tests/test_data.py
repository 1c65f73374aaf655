"""Packed-document datasets: batches against a plain loop over the documents, sampling, sharding, resumption."""

import json
import random
import re

import pytest
import torch

from blockzoo import config as config_module
from blockzoo.config import ConfigError
from blockzoo.data.config import DatasetConfig, EmbeddedDatasetConfig, MemmapDatasetConfig, RandomDatasetConfig
from blockzoo.data.dataset import IGNORE_INDEX, build_dataset
from blockzoo.data.errors import DatasetError
from blockzoo.data.storage import DatasetWriter
from blockzoo.data.tokenizer import ByteTokenizer
from blockzoo.layers.base import Batch
from blockzoo.plugins import get_registry


@pytest.fixture(autouse=True)
def dataset_types():
    assert get_registry().available("dataset") == ["blended", "embedded", "memmap", "random"]


def make_documents(count: int, seed: int = 0, max_length: int = 30) -> list[list[int]]:
    """Documents of random token ids (so windows are unique) and lengths, including one-token documents."""
    rng = random.Random(seed)
    return [[rng.randrange(257) for _ in range(rng.randint(1, max_length))] for _ in range(count)]


def write(prefix, documents) -> str:
    with DatasetWriter(prefix, ByteTokenizer()) as writer:
        for document in documents:
            writer.add(document)
    return str(prefix)


def reference_windows(documents: list[list[int]], length: int) -> list[tuple[list[int], list[int], list[int]]]:
    """(tokens, labels, lengths) of each non-overlapping window of the concatenated documents, by a plain loop."""
    stream = [(token, number) for number, document in enumerate(documents) for token in document]
    windows = []
    for start in range(0, len(stream) - length + 1, length):
        window = stream[start : start + length]
        tokens = [token for token, _ in window]
        labels = [
            window[t + 1][0] if t + 1 < length and window[t + 1][1] == window[t][1] else IGNORE_INDEX
            for t in range(length)
        ]
        lengths = []
        for t in range(length):
            if t == 0 or window[t][1] != window[t - 1][1]:
                lengths.append(0)
            lengths[-1] += 1
        windows.append((tokens, labels, lengths))
    return windows


def sequences(batch, length: int) -> list[tuple[list[int], list[int], list[int]]]:
    """Split a micro-batch into its sequences: (tokens, labels, lengths) each."""
    assert batch.tokens.dtype == batch.labels.dtype == batch.lengths.dtype == torch.int64
    assert len(batch.tokens) % length == 0 and int(batch.lengths.sum()) == len(batch.tokens)
    pieces = batch.lengths.tolist()
    result = []
    for start in range(0, len(batch.tokens), length):
        lengths = []
        while sum(lengths) < length:
            lengths.append(pieces.pop(0))
        assert sum(lengths) == length, "a document piece crosses a sequence boundary"
        end = start + length
        result.append((batch.tokens[start:end].tolist(), batch.labels[start:end].tolist(), lengths))
    return result


def memmap(prefix, **fields) -> MemmapDatasetConfig:
    return MemmapDatasetConfig(path=str(prefix), **fields)


def take(batches, count: int) -> list:
    return [next(batches) for _ in range(count)]


def same(first, second) -> bool:
    return all(torch.equal(getattr(first, n), getattr(second, n)) for n in ("tokens", "labels", "lengths"))


# ---------------------------------------------------------------------------------------------------------------------
# Batches


def test_an_epoch_of_training_batches_is_every_window_once_with_labels_inside_documents(tmp_path):
    documents = make_documents(120)
    length = 16
    reference = reference_windows(documents, length)
    dataset = build_dataset(memmap(write(tmp_path / "d", documents), sequence_length=length), seed=3)
    batches = dataset.training_batches()
    seen = []
    for batch in take(batches, len(reference)):
        assert Batch(batch.lengths).num_tokens == len(batch.tokens) == length
        (found,) = sequences(batch, length)
        seen.append(reference.index(found))  # tokens, labels and lengths all as the plain loop gives them
    assert sorted(seen) == list(range(len(reference)))
    assert seen != sorted(seen), "windows are visited in a shuffled order"
    # The next epoch visits every window again, in another order.
    next_epoch = [reference.index(sequences(batch, length)[0]) for batch in take(batches, len(reference))]
    assert sorted(next_epoch) == sorted(seen) and next_epoch != seen


def test_a_dataset_with_more_token_ids_than_the_model_is_refused(tmp_path):
    config = memmap(write(tmp_path / "d", make_documents(10)), sequence_length=4)
    assert build_dataset(config, seed=0, model_vocab_size=257).vocab_size == 257
    with pytest.raises(DatasetError, match=r"uses 257 token ids, more than the model's vocabulary .* = 256\)"):
        build_dataset(config, seed=0, model_vocab_size=256)


def test_micro_batches_pack_sequences_whose_boundaries_are_document_boundaries(tmp_path):
    documents = make_documents(200, seed=1, max_length=70)
    length, micro_batch_size = 32, 3
    reference = reference_windows(documents, length)
    config = memmap(write(tmp_path / "d", documents), sequence_length=length, micro_batch_size=micro_batch_size)
    for batch in take(build_dataset(config, seed=0).training_batches(), 10):
        assert len(batch.tokens) == micro_batch_size * length
        for found in sequences(batch, length):
            assert found in reference
        # A label is the next token, unless a document ends there.
        ends = batch.lengths.cumsum(0) - 1
        inside = torch.ones(len(batch.tokens), dtype=torch.bool)
        inside[ends] = False
        assert torch.equal(batch.labels[inside], batch.tokens[1:][inside[:-1]])
        assert bool((batch.labels[ends] == IGNORE_INDEX).all())


def test_the_evaluation_split_is_the_last_documents_read_in_order_from_its_start(tmp_path):
    documents = make_documents(100, seed=2)
    length = 8
    config = memmap(write(tmp_path / "d", documents), sequence_length=length, validation_fraction=0.2)
    dataset = build_dataset(config, seed=0)
    expected = reference_windows(documents[80:], length)
    found = [sequences(batch, length)[0] for batch in dataset.evaluation_batches()]
    assert found == expected
    assert [sequences(b, length)[0] for b in dataset.evaluation_batches()] == expected  # again from the start
    # Two ranks with micro-batches of 2: rank r's micro-batch m holds samples 4m + r and 4m + 2 + r.
    pairs = build_dataset(config_module.update(config, {"micro_batch_size": 2}), seed=0)
    for rank in (0, 1):
        sharded = [s for b in pairs.evaluation_batches(rank=rank, ranks=2) for s in sequences(b, length)]
        rounds = len(expected) // 4
        assert sharded == [expected[4 * m + 2 * i + rank] for m in range(rounds) for i in range(2)]
    # Training never reads an evaluation window.
    training = {tuple(sequences(b, length)[0][0]) for b in take(dataset.training_batches(), 100)}
    assert training.isdisjoint(tuple(tokens) for tokens, _, _ in expected)
    assert training <= {tuple(tokens) for tokens, _, _ in reference_windows(documents[:80], length)}


# ---------------------------------------------------------------------------------------------------------------------
# Determinism, resumption, sharding


@pytest.fixture(params=["memmap", "random", "embedded"])
def data_config(request, tmp_path) -> DatasetConfig:
    if request.param == "memmap":
        # About 37 windows: the streams below cross epochs.
        return memmap(write(tmp_path / "d", make_documents(30, seed=4)), sequence_length=12, micro_batch_size=2)
    if request.param == "random":
        return RandomDatasetConfig(vocab_size=100, sequence_length=12, micro_batch_size=2, max_document_length=5)
    return EmbeddedDatasetConfig(num_documents=20, sequence_length=12, micro_batch_size=2)


def test_resuming_from_a_saved_position_continues_the_uninterrupted_stream(data_config):
    uninterrupted = take(build_dataset(data_config, seed=7).training_batches(), 30)
    first = build_dataset(data_config, seed=7).training_batches()
    take(first, 11)
    position = json.loads(json.dumps(first.position()))  # stored in a checkpoint's metadata
    resumed = build_dataset(data_config, seed=7).training_batches(position=position)  # a new process
    assert all(same(a, b) for a, b in zip(take(resumed, 19), uninterrupted[11:]))


def test_batches_depend_only_on_the_seed(data_config):
    one, two = (take(build_dataset(data_config, seed=5).training_batches(), 4) for _ in range(2))
    assert all(same(a, b) for a, b in zip(one, two))
    other = take(build_dataset(data_config, seed=6).training_batches(), 4)
    assert not all(same(a, b) for a, b in zip(one, other))
    # The config's seed wins over the run's.
    seeded = config_module.update(data_config, {"seed": 6})
    assert all(same(a, b) for a, b in zip(take(build_dataset(seeded, seed=5).training_batches(), 4), other))


def test_data_parallel_ranks_take_every_nth_sample_without_overlap(data_config):
    ranks, micro_batch_size, rounds = 3, data_config.micro_batch_size, 5
    length = data_config.sequence_length
    single = config_module.update(data_config, {"micro_batch_size": 1})
    samples = [sequences(b, length)[0] for b in take(build_dataset(single, seed=1).training_batches(), 40)]
    covered = []
    for rank in range(ranks):
        batches = build_dataset(data_config, seed=1).training_batches(rank=rank, ranks=ranks)
        for m, batch in enumerate(take(batches, rounds)):
            indices = [(m * micro_batch_size + i) * ranks + rank for i in range(micro_batch_size)]
            assert sequences(batch, length) == [samples[j] for j in indices]
            covered += indices
    assert sorted(covered) == list(range(ranks * micro_batch_size * rounds))  # every sample, once


def test_a_position_saved_with_two_ranks_resumes_on_one(data_config):
    length = data_config.sequence_length
    single = config_module.update(data_config, {"micro_batch_size": 1})
    samples = [sequences(b, length)[0] for b in take(build_dataset(single, seed=2).training_batches(), 20)]
    pair = [build_dataset(data_config, seed=2).training_batches(rank=rank, ranks=2) for rank in range(2)]
    for batches in pair:
        take(batches, 3)
    assert pair[0].position() == pair[1].position() == {"next_sample": 3 * 2 * data_config.micro_batch_size}
    resumed = build_dataset(single, seed=2).training_batches(position=pair[0].position())
    assert [sequences(b, length)[0] for b in take(resumed, 4)] == samples[12:16]


@pytest.mark.parametrize(
    "position", [{"next_sample": -1}, {"next_sample": "3"}, {"next_sample": True}, {"step": 3}, [3], "3"]
)
def test_a_bad_position_is_refused(position):
    dataset = build_dataset(RandomDatasetConfig(vocab_size=10, sequence_length=4), seed=0)
    with pytest.raises(DatasetError, match="bad data position"):
        dataset.training_batches(position=position)


@pytest.mark.parametrize(("rank", "ranks"), [(2, 2), (-1, 2), (0, 0)])
def test_a_bad_rank_is_refused(rank, ranks):
    dataset = build_dataset(RandomDatasetConfig(vocab_size=10, sequence_length=4), seed=0)
    with pytest.raises(ValueError, match="data-parallel rank"):
        dataset.training_batches(rank=rank, ranks=ranks)


# ---------------------------------------------------------------------------------------------------------------------
# The random dataset


def test_random_documents_fill_each_sequence_within_the_length_range():
    config = RandomDatasetConfig(vocab_size=50, sequence_length=64, micro_batch_size=4, min_document_length=3,
                                 max_document_length=9)  # fmt: skip
    dataset = build_dataset(config, seed=0)
    for batch in take(dataset.training_batches(), 5):
        for tokens, labels, lengths in sequences(batch, 64):
            assert all(3 <= n <= 9 for n in lengths[:-1]) and 1 <= lengths[-1] <= 9
            assert min(tokens) >= 0 and max(tokens) < 50
            edges = set(torch.tensor(lengths).cumsum(0).tolist())
            assert labels == [IGNORE_INDEX if t + 1 in edges else tokens[t + 1] for t in range(64)]
    evaluation = next(dataset.evaluation_batches())
    assert not same(evaluation, next(dataset.training_batches())), "the evaluation stream is another stream"
    assert same(evaluation, next(build_dataset(config, seed=0).evaluation_batches()))


def test_random_vocabulary_defaults_to_the_models():
    config = RandomDatasetConfig(sequence_length=256)
    dataset = build_dataset(config, seed=0, model_vocab_size=7)
    assert dataset.vocab_size == 7 and int(next(dataset.training_batches()).tokens.max()) == 6
    with pytest.raises(DatasetError, match=r"needs data\.vocab_size"):
        build_dataset(config, seed=0)
    with pytest.raises(DatasetError, match=r"uses 9 token ids, more than the model's vocabulary.*= 7"):
        build_dataset(RandomDatasetConfig(vocab_size=9), seed=0, model_vocab_size=7)


# ---------------------------------------------------------------------------------------------------------------------
# Configs


def test_configs_structure_from_yaml_data_with_memmap_the_default_type():
    data = config_module.structure(
        {"path": "data/tokens", "sequence_length": 4096, "micro_batch_size": 8}, DatasetConfig
    )
    assert data == MemmapDatasetConfig(path="data/tokens", sequence_length=4096, micro_batch_size=8)
    assert config_module.to_dict(data, explicit_only=True) == {
        "type": "memmap", "path": "data/tokens", "sequence_length": 4096, "micro_batch_size": 8,
    }  # fmt: skip
    embedded = config_module.structure({"type": "embedded", "num_documents": 50}, DatasetConfig)
    assert embedded == EmbeddedDatasetConfig(num_documents=50)


@pytest.mark.parametrize(
    ("data", "path", "message"),
    [
        ({"sequence_length": 0}, "sequence_length", "must be >= 1"),
        ({"micro_batch_size": 0}, "micro_batch_size", "must be >= 1"),
        ({"validation_fraction": 1.5}, "validation_fraction", r"must be in \[0, 1\]"),
        ({"type": "embedded", "num_documents": 1}, "num_documents", "must be >= 2"),
        ({"type": "random", "min_document_length": 4, "max_document_length": 3}, "max_document_length", ">= min"),
        ({"type": "random", "vocab_size": 0}, "vocab_size", "must be >= 1"),
        ({"type": "mmap"}, "type", "did you mean 'memmap'"),
        ({"file": "x"}, "file", "unknown key"),
    ],
)
def test_bad_configs_name_the_field(data, path, message):
    with pytest.raises(ConfigError) as caught:
        config_module.structure(data, DatasetConfig)
    ((where, error),) = caught.value.errors
    assert where == path
    assert re.search(message, error)


@pytest.mark.parametrize(
    ("change", "effect"),
    [
        ({"sequence_length": 24}, "the tokens per sequence"),
        ({"micro_batch_size": 3}, "the sequences per micro-batch"),
        ({"seed": 99}, "the order"),
        ({"validation_fraction": 0.5}, "the training windows"),
        ({"path": "other"}, "the documents"),
    ],
)
def test_every_memmap_field_changes_the_batches(tmp_path, change, effect):
    write(tmp_path / "d", make_documents(60, seed=8))
    write(tmp_path / "other", make_documents(60, seed=9))
    base = {"path": str(tmp_path / "d"), "sequence_length": 12, "validation_fraction": 0.1}
    if "path" in change:
        change = {"path": str(tmp_path / change["path"])}
    batches = [
        take(build_dataset(config_module.structure(data, MemmapDatasetConfig), seed=0).training_batches(), 5)
        for data in (base, {**base, **change})
    ]
    assert not all(same(a, b) for a, b in zip(*batches)), effect


@pytest.mark.parametrize(
    "change",
    [
        {"type": "embedded", "num_documents": 30},
        {"type": "embedded", "validation_fraction": 0.5},
        {"type": "random", "vocab_size": 30},
        {"type": "random", "min_document_length": 5},
        {"type": "random", "max_document_length": 3},
    ],
)
def test_every_embedded_and_random_field_changes_the_batches(change):
    base = {"type": change["type"], "sequence_length": 16, "micro_batch_size": 4}
    if change["type"] == "embedded":
        base["num_documents"] = 60
    else:
        base["vocab_size"] = 40
    batches = [
        take(build_dataset(config_module.structure(data, DatasetConfig), seed=0).training_batches(), 3)
        for data in (base, {**base, **change})
    ]
    assert not all(same(a, b) for a, b in zip(*batches))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_memory_mapped_batches_move_to_the_gpu(tmp_path):
    documents = make_documents(50, seed=10)
    config = memmap(write(tmp_path / "d", documents), sequence_length=16, micro_batch_size=2)
    batch = next(build_dataset(config, seed=0).training_batches())
    on_gpu = batch.to("cuda")
    assert on_gpu.tokens.is_cuda and on_gpu.labels.is_cuda
    assert torch.equal(on_gpu.tokens.cpu(), batch.tokens) and torch.equal(on_gpu.labels.cpu(), batch.labels)
    gpu_batch = Batch(on_gpu.lengths, device="cuda")
    assert torch.equal(gpu_batch.cu_seqlens.cpu(), Batch(batch.lengths).cu_seqlens)
