"""The `blended` dataset: exact proportions at every prefix, each source's own samples, source_tokens, its evaluation
split, the held-out documents of a prepared dataset never trained on, and every bad source named."""

import random
import re
from fractions import Fraction

import pytest
import torch

from blockzoo import config as config_module
from blockzoo.config import ConfigError
from blockzoo.data.blended import BlendIndex
from blockzoo.data.config import DatasetConfig, MemmapDatasetConfig
from blockzoo.data.dataset import build_dataset
from blockzoo.data.errors import DatasetError
from blockzoo.data.storage import DatasetWriter
from blockzoo.data.tokenizer import ByteTokenizer, FileTokenizer

LENGTH = 8


def write(prefix, documents, tokenizer=None) -> str:
    with DatasetWriter(prefix, tokenizer or ByteTokenizer()) as writer:
        for document in documents:
            writer.add(document)
    return str(prefix)


def documents(count: int, seed: int, low: int = 0, high: int = 256) -> list[list[int]]:
    """Documents of random tokens in [low, high) (windows are unique) and random lengths."""
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(rng.randint(1, 20))] for _ in range(count)]


def blend(sources: dict, **fields) -> DatasetConfig:
    data = {"type": "blended", "sequence_length": LENGTH, "micro_batch_size": 2, "sources": sources, **fields}
    return config_module.structure(data, DatasetConfig)


def greedy_reference(weights: list[float], samples: int) -> list[int]:
    """The blend's rule as the brief states it, in exact fractions: sample i goes to the source whose count lags its
    share × (i + 1) the most, ties to the first."""
    shares = [Fraction(repr(w)) / sum(Fraction(repr(v)) for v in weights) for w in weights]
    counts, order = [0] * len(weights), []
    for i in range(samples):
        lags = [share * (i + 1) - count for share, count in zip(shares, counts)]
        chosen = lags.index(max(lags))
        counts[chosen] += 1
        order.append(chosen)
    return order


@pytest.mark.parametrize("weights", [[0.7, 0.2, 0.1], [3, 1, 1.5], [1, 1], [0.05, 0.9, 0.03, 0.02]])
def test_every_prefix_holds_each_share_within_one_sample_and_exactly_after_each_period(weights, monkeypatch):
    monkeypatch.setattr(BlendIndex, "CHUNK", 997)  # many chunks, evicted from the cache and computed again
    index = BlendIndex(weights)
    samples = 6_000
    located = [index.locate(i) for i in range(samples)]
    assert [source for source, _ in located] == greedy_reference(weights, samples)
    shares = [Fraction(repr(float(w))) for w in weights]
    shares = [share / sum(shares) for share in shares]
    counts = [0] * len(weights)
    for n, (source, within) in enumerate(located, start=1):
        assert within == counts[source]  # a source's samples are taken in order
        counts[source] += 1
        for count, share in zip(counts, shares):
            assert abs(count - share * n) < 1, (n, counts)
        if n % index.period == 0:
            assert counts == [share * n for share in shares], n
    assert index.counts(samples) == counts
    assert index.counts(4_321) == [sum(1 for s, _ in located[:4_321] if s == k) for k in range(len(weights))]
    # A fresh index asked for a late sample first (a resumed run) agrees.
    assert BlendIndex(weights).locate(samples - 1) == located[-1]


def test_the_default_chunks_agree_with_small_ones(monkeypatch):
    default = BlendIndex([0.6, 0.3, 0.1])
    far = [default.locate(i) for i in range(200_000, 200_050)]
    monkeypatch.setattr(BlendIndex, "CHUNK", 4093)
    small = BlendIndex([0.6, 0.3, 0.1])
    assert [small.locate(i) for i in range(200_000, 200_050)] == far
    assert default.counts(200_000) == [120_000, 60_000, 20_000]


@pytest.fixture
def sources(tmp_path) -> dict[str, str]:
    return {
        "web": write(tmp_path / "web", documents(80, seed=1)),
        "code": write(tmp_path / "code", documents(50, seed=2)),
    }


def test_each_sources_kth_sample_is_its_own_kth_training_sample(sources):
    config = blend(
        {
            "web": {"weight": 3, "path": sources["web"], "validation_fraction": 0.1},
            "code": {"weight": 1, "path": sources["code"]},
            "stories": {"weight": 1, "dataset": {"type": "embedded", "num_documents": 40, "sequence_length": 99}},
        }
    )
    dataset = build_dataset(config, seed=5)
    alone = {
        "web": build_dataset(
            MemmapDatasetConfig(path=sources["web"], sequence_length=LENGTH, validation_fraction=0.1), seed=5
        ),
        "code": build_dataset(MemmapDatasetConfig(path=sources["code"], sequence_length=LENGTH), seed=5),
        "stories": build_dataset(
            config_module.structure(
                {"type": "embedded", "num_documents": 40, "sequence_length": LENGTH}, DatasetConfig
            ),
            seed=5,
        ),
    }
    order = greedy_reference([3, 1, 1], 300)
    taken = dict.fromkeys(alone, 0)
    names = list(alone)
    for i, source in enumerate(order):
        name = names[source]
        sample, expected = dataset.training_sample(i), alone[name].training_sample(taken[name])
        assert torch.equal(sample.tokens, expected.tokens) and sample.lengths == expected.lengths, (i, name)
        taken[name] += 1
    assert dataset.vocab_size == 257 and isinstance(dataset.tokenizer, ByteTokenizer)
    # source_tokens: each source's samples so far × the sequence length, from the position alone.
    assert dataset.source_tokens({"next_sample": 300}) == {name: count * LENGTH for name, count in taken.items()}
    assert sum(dataset.source_tokens({"next_sample": 137}).values()) == 137 * LENGTH
    assert dataset.source_tokens(None) == dict.fromkeys(names, 0)


def test_the_batches_are_the_same_on_any_number_of_ranks(sources):
    config = blend({"web": {"weight": 0.7, "path": sources["web"]}, "code": {"weight": 0.3, "path": sources["code"]}})
    one = build_dataset(config, seed=1).training_batches(rank=0, ranks=1)
    whole = torch.cat([next(one).tokens for _ in range(6)])
    two = [build_dataset(config, seed=1).training_batches(rank=rank, ranks=2) for rank in range(2)]
    rounds = [[next(batches).tokens.view(2, LENGTH) for batches in two] for _ in range(3)]
    # Round r of rank k holds global samples 4r + k and 4r + k + 2.
    interleaved = torch.cat([torch.stack([a[0], b[0], a[1], b[1]]).flatten() for a, b in rounds])
    assert torch.equal(whole, interleaved)


def test_a_source_read_whole_is_read_again_and_said_once(sources):
    config = blend({"web": {"weight": 0.5, "path": sources["web"]}, "code": {"weight": 0.5, "path": sources["code"]}})
    messages = []
    dataset = build_dataset(config, seed=0, log=messages.append)
    code = build_dataset(MemmapDatasetConfig(path=sources["code"], sequence_length=LENGTH), seed=0)
    epoch = code.num_training_samples
    batches = dataset.training_batches()
    for _ in range(epoch):  # two samples a micro-batch, one from each source: code read whole once, web not yet
        next(batches)
    assert messages == []
    next(batches)
    assert len(messages) == 1 and "'code' has been read whole" in messages[0] and f"({epoch} training" in messages[0]
    for _ in range(3 * epoch):  # three more epochs of code, two of web
        next(batches)
    assert len(messages) == 2 and "'web' has been read whole" in messages[1]
    # Its second epoch is its own second epoch (another order).
    assert torch.equal(dataset.training_sample(2 * epoch + 1).tokens, code.training_sample(epoch).tokens)


def test_the_evaluation_split_interleaves_the_sources_that_hold_out_up_to_the_first_that_runs_out(sources):
    config = blend(
        {
            "web": {"weight": 1, "path": sources["web"], "validation_fraction": 0.3},
            "none": {"weight": 5, "path": sources["code"]},  # holds nothing out: not in the split
            "code": {"weight": 1, "path": sources["code"], "validation_fraction": 0.2},
        }
    )
    dataset = build_dataset(config, seed=0)
    held_out = {
        name: build_dataset(
            MemmapDatasetConfig(path=sources[name], sequence_length=LENGTH, validation_fraction=f), seed=0
        )
        for name, f in (("web", 0.3), ("code", 0.2))
    }
    sizes = {name: held.num_evaluation_samples for name, held in held_out.items()}
    expected = 2 * min(sizes.values()) + (1 if sizes["web"] > sizes["code"] else 0)  # alternating, web first
    assert dataset.num_evaluation_samples == expected
    for i in range(expected):
        name, k = ("web", "code")[i % 2], i // 2
        assert torch.equal(dataset.evaluation_sample(i).tokens, held_out[name].evaluation_sample(k).tokens)
    with pytest.raises(IndexError):
        dataset.evaluation_sample(expected)


def test_held_out_documents_never_appear_in_the_training_stream(tmp_path):
    """Training documents use token ids below 128, the held-out ones (the last quarter) 128 and above: two whole
    epochs of the training stream, alone and through a blend, hold no id >= 128, and every training window once."""
    training, held = documents(60, seed=3, high=128), documents(20, seed=4, low=128)
    path = write(tmp_path / "d", training + held)
    config = MemmapDatasetConfig(path=path, sequence_length=LENGTH, micro_batch_size=1, validation_fraction=0.25)
    dataset = build_dataset(config, seed=0)
    windows = len([token for document in training for token in document]) // LENGTH
    assert dataset.num_training_samples == windows
    epoch = [dataset.training_sample(i).tokens for i in range(2 * windows)]
    assert max(int(tokens.max()) for tokens in epoch) < 128
    stream = torch.tensor([token for document in training for token in document])
    expected = {tuple(stream[w * LENGTH : (w + 1) * LENGTH].tolist()) for w in range(windows)}
    assert {tuple(tokens.tolist()) for tokens in epoch[:windows]} == expected  # each window once per epoch
    evaluation = [dataset.evaluation_sample(i).tokens for i in range(dataset.num_evaluation_samples)]
    assert evaluation and min(int(tokens.min()) for tokens in evaluation) >= 128
    blended = build_dataset(
        blend({"d": {"weight": 1, "path": path, "validation_fraction": 0.25}, "e": {"weight": 1, "path": path}}), seed=0
    )
    # d's samples are the even ones (equal weights, ties to the first): two epochs of d hold no held-out id.
    source_d = [blended.training_sample(i).tokens for i in range(0, 4 * windows, 2)]
    assert max(int(tokens.max()) for tokens in source_d) < 128


def test_validation_fraction_1_makes_an_evaluation_only_dataset(tmp_path):
    path = write(tmp_path / "val", documents(10, seed=5))
    config = MemmapDatasetConfig(path=path, sequence_length=LENGTH, validation_fraction=1)
    evaluation_only = build_dataset(config, seed=0, training=False)
    stream = torch.tensor([token for document in documents(10, seed=5) for token in document])
    assert evaluation_only.num_evaluation_samples == len(stream) // LENGTH
    assert torch.equal(evaluation_only.evaluation_sample(0).tokens, stream[:LENGTH])
    with pytest.raises(DatasetError, match="no training samples: validation_fraction 1"):
        build_dataset(config, seed=0)


# ---------------------------------------------------------------------------------------------------------------------
# Bad blends


@pytest.mark.parametrize(
    ("source", "field", "message"),
    [
        ({"weight": 0, "path": "x"}, "sources.web.weight", "must be > 0"),
        ({"weight": -0.5, "path": "x"}, "sources.web.weight", "must be > 0"),
        ({"weight": 1}, "sources.web.path", "either `path`.*or `dataset`.*neither"),
        ({"weight": 1, "path": "x", "dataset": {"type": "embedded"}}, "sources.web.path", "not both"),
        (
            {"weight": 1, "dataset": {"type": "embedded"}, "validation_fraction": 0.1},
            "sources.web.validation_fraction",
            "",
        ),
    ],
)
def test_bad_sources_are_config_errors_naming_the_field(source, field, message):
    with pytest.raises(ConfigError) as caught:
        blend({"web": source})
    ((where, error),) = caught.value.errors
    assert where == field
    assert re.search(message, error), error


def test_a_blend_without_sources_is_refused():
    with pytest.raises(ConfigError) as caught:
        blend({})
    assert caught.value.errors[0][0] == "sources"


def test_bad_sources_are_refused_naming_them(tmp_path, sources):
    with DatasetWriter(tmp_path / "empty", ByteTokenizer()):
        pass  # no documents
    cases = {
        "empty": ({"weight": 1, "path": str(tmp_path / "empty")}, "holds no documents"),
        "missing": ({"weight": 1, "path": str(tmp_path / "absent")}, "no dataset at"),
        "tiny": ({"weight": 1, "path": write(tmp_path / "tiny", [[1, 2, 3]])}, "fewer than one sequence"),
    }
    for name, (source, problem) in cases.items():
        with pytest.raises(DatasetError) as caught:
            build_dataset(blend({"web": {"weight": 1, "path": sources["web"]}, name: source}), seed=0)
        assert f"blended data source {name!r}" in str(caught.value) and problem in str(caught.value), str(caught.value)
    with pytest.raises(DatasetError, match=r"source 'web' \(sources.web.path.*model's vocabulary"):
        build_dataset(blend({"web": {"weight": 1, "path": sources["web"]}}), seed=0, model_vocab_size=100)


def test_sources_of_different_tokenizers_or_vocabularies_are_refused_naming_both(tmp_path, sources):
    tokenizers = pytest.importorskip("tokenizers")
    vocabulary = {"[UNK]": 0, "a": 1, "b": 2}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="[UNK]"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    model.save(str(tmp_path / "tokenizer.json"))
    words = FileTokenizer(tmp_path / "tokenizer.json")
    hf = write(tmp_path / "words", [[1, 2, 1, 2, 1, 2, 1, 2, 1]] * 4, tokenizer=words)
    with pytest.raises(DatasetError) as caught:
        build_dataset(blend({"web": {"weight": 1, "path": sources["web"]}, "words": {"weight": 1, "path": hf}}), seed=0)
    message = str(caught.value)
    assert "sources 'web' and 'words' do not share a tokenizer" in message
    assert "the byte tokenizer, 257 token ids" in message and "tokenizer.json (sha256" in message, message
    # Two copies of one tokenizer.json (each prepared dataset keeps its own) agree.
    hf_again = write(tmp_path / "words2", [[2, 1, 2, 1, 2, 1, 2, 1, 2]] * 4, tokenizer=words)
    agreed = build_dataset(blend({"a": {"weight": 1, "path": hf}, "b": {"weight": 1, "path": hf_again}}), seed=0)
    assert agreed.vocab_size == 3
    randoms = {
        name: {"weight": 1, "dataset": {"type": "random", "vocab_size": size}} for name, size in (("r", 50), ("s", 60))
    }
    with pytest.raises(DatasetError, match="'r' has no tokenizer, 50 token ids, 's' has no tokenizer, 60 token ids"):
        build_dataset(blend(randoms), seed=0)


def test_validation_sets_without_an_evaluation_interval_are_refused_at_the_field():
    from blockzoo.run_config import RunConfig

    evaluation = {"datasets": {"web": {"type": "embedded"}}}
    with pytest.raises(ConfigError) as caught:
        config_module.structure({"data": {"type": "embedded"}, "training": {"evaluation": evaluation}}, RunConfig)
    ((where, error),) = caught.value.errors
    assert where == "training.evaluation.datasets" and "training.evaluation.interval" in error
