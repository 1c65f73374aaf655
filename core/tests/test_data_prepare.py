"""`blockzoo prepare` and the memmap files: what is written reads back as the tokenized documents; bad inputs and
damaged files give errors that name what is wrong."""

import argparse
import itertools
import json
import sys

import pytest
import torch

from blockzoo.cli import UsageError
from blockzoo.data.cli import register_data_command
from blockzoo.data.config import MemmapDatasetConfig
from blockzoo.data.errors import DatasetError
from blockzoo.data.memmap import MemmapDataset
from blockzoo.data.prepare import prepare
from blockzoo.data.storage import DatasetFiles, DatasetWriter, token_dtype
from blockzoo.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

EOD = ByteTokenizer.eod_token_id


def byte_ids(text: str) -> list[int]:
    return [*text.encode("utf-8"), EOD]


def stored_documents(prefix) -> list[list[int]]:
    """The documents of a prepared dataset, read through the memmap dataset's store."""
    store = MemmapDataset(MemmapDatasetConfig(path=str(prefix), sequence_length=1), seed=0).store
    offsets = store.offsets.tolist()
    return [store.tokens[a:b].tolist() for a, b in itertools.pairwise(offsets)]


def run_prepare(*arguments: str) -> int:
    """`blockzoo prepare ARGUMENTS` through the command's own parser (the `blockzoo` main turns a UsageError into
    exit code 2)."""
    parser = argparse.ArgumentParser(prog="blockzoo")
    register_data_command(parser.add_subparsers())
    parsed = parser.parse_args(["prepare", *arguments])
    return parsed.run(parsed)


# ---------------------------------------------------------------------------------------------------------------------
# What is written


def test_text_paragraph_and_jsonl_documents_read_back_as_their_bytes(tmp_path, capsys):
    (tmp_path / "one.txt").write_text("The first file.\n\nIs one document: déjà vu.\n")
    (tmp_path / "empty.txt").write_text(" \n\n")
    (tmp_path / "paragraphs.txt").write_text("First paragraph,\ntwo lines.\n\n\n  \nSecond one.\n\nThird 🙂")
    records = [{"text": "a jsonl document", "id": 1}, {"text": ""}, {"text": "another\nwith a newline"}]
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    prefix = tmp_path / "out" / "tokens"

    assert run_prepare(str(tmp_path / "one.txt"), str(tmp_path / "empty.txt"), "-o", str(prefix)) == 0
    assert "wrote 1 documents" in capsys.readouterr().out
    assert stored_documents(prefix) == [byte_ids("The first file.\n\nIs one document: déjà vu.\n")]

    run_prepare(
        str(tmp_path / "paragraphs.txt"), str(tmp_path / "one.txt"), "--format", "paragraphs", "-o", str(prefix)
    )
    expected = [
        "First paragraph,\ntwo lines.",
        "Second one.",
        "Third 🙂",
        "The first file.",
        "Is one document: déjà vu.",
    ]
    assert stored_documents(prefix) == [byte_ids(text) for text in expected]

    run_prepare(str(tmp_path / "docs.jsonl"), "--format", "jsonl", "-o", str(prefix))
    assert stored_documents(prefix) == [byte_ids("a jsonl document"), byte_ids("another\nwith a newline")]
    metadata = json.loads((tmp_path / "out" / "tokens.json").read_text())
    num_tokens = len(byte_ids("a jsonl document")) + len(byte_ids("another\nwith a newline"))
    assert metadata == {
        "format": "blockzoo-tokens",
        "version": 2,
        "dtype": "uint16",
        "vocab_size": 257,
        "eod_token_id": 256,
        "num_documents": 2,
        "num_tokens": num_tokens,
        "tokenizer": {"type": "byte"},
        "sources": [str(tmp_path / "docs.jsonl")],
        "shards": [{"name": "tokens", "num_documents": 2, "num_tokens": num_tokens}],
    }
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["tokens.bin", "tokens.idx", "tokens.json"]


def test_a_jsonl_field_is_chosen_by_name(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"content": "x", "text": "y"}\n')
    run_prepare(str(tmp_path / "d.jsonl"), "--format", "jsonl", "--field", "content", "-o", str(tmp_path / "t"))
    assert stored_documents(tmp_path / "t") == [byte_ids("x")]


class Vocabulary(Tokenizer):
    """A stand-in tokenizer of a given vocabulary size, to write every token dtype."""

    eod_token_id = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def to_metadata(self):
        return {"type": "byte"}


@pytest.mark.parametrize(
    ("vocab_size", "dtype"), [(256, "uint8"), (257, "uint16"), (65536, "uint16"), (70000, "uint32")]
)
def test_tokens_take_the_smallest_unsigned_dtype_and_read_back(tmp_path, vocab_size, dtype):
    assert token_dtype(vocab_size) == dtype
    documents = [[vocab_size - 1, 0, 7], [vocab_size - 2], list(range(5))]
    with DatasetWriter(tmp_path / "t", Vocabulary(vocab_size)) as writer:
        for document in documents:
            writer.add(document)
    assert (tmp_path / "t.bin").stat().st_size == 9 * {"uint8": 1, "uint16": 2, "uint32": 4}[dtype]
    assert stored_documents(tmp_path / "t") == documents


def test_a_failed_prepare_leaves_no_files(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "fine"}\n{"text": 3}\n')
    with pytest.raises(DatasetError):
        prepare([tmp_path / "d.jsonl"], tmp_path / "out" / "t", format="jsonl")
    assert list((tmp_path / "out").iterdir()) == []


# ---------------------------------------------------------------------------------------------------------------------
# Bad inputs


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"text": "ok"}\n{"text": "ok", \n', r"d\.jsonl line 2: not valid JSON"),
        ('{"text": "ok"}\n\n[1, 2]\n', r"d\.jsonl line 3: expected a JSON object, got list"),
        (
            '{"text": "ok"}\n{"body": "no text", "id": 4}\n',
            r"d\.jsonl line 2: no field 'text' \(its fields: 'body', 'id'\)",
        ),
        ('{"text": ["a"]}\n', r"d\.jsonl line 1: field 'text' holds list, expected a string"),
    ],
)
def test_a_bad_jsonl_line_is_named(tmp_path, content, message):
    (tmp_path / "d.jsonl").write_text(content)
    with pytest.raises(UsageError, match=message):
        run_prepare(str(tmp_path / "d.jsonl"), "--format", "jsonl", "-o", str(tmp_path / "t"))


def test_bad_inputs_are_named(tmp_path):
    (tmp_path / "empty.txt").write_text("\n \n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "ok.txt").write_text("text")
    out, ok = str(tmp_path / "t"), str(tmp_path / "ok.txt")
    cases = [
        ([str(tmp_path / "missing.txt"), "-o", out], r"input .*missing\.txt does not exist"),
        ([str(tmp_path / "empty.txt"), "-o", out], r"the corpus is empty: .*empty\.txt hold no document"),
        ([str(tmp_path / "latin1.txt"), "-o", out], r"latin1\.txt is not UTF-8 text"),
        ([ok, "-o", str(tmp_path)], "is a directory; give a path prefix"),
        ([ok, "-o", out, "--eod-token", "</s>"], "byte tokenizer's end-of-document token is fixed"),
        ([ok, "-o", out, "--tokenizer", str(tmp_path / "nope.json")], r"nope\.json does not exist"),
    ]
    for arguments, message in cases:
        with pytest.raises(UsageError, match=message):
            run_prepare(*arguments)
    assert not (tmp_path / "t.json").exists()


def test_a_hugging_face_tokenizer_without_the_tokenizers_package_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(DatasetError, match="needs the `tokenizers` package: pip install tokenizers"):
        load_tokenizer(tmp_path)


# ---------------------------------------------------------------------------------------------------------------------
# Damaged datasets


@pytest.fixture
def prepared(tmp_path) -> DatasetFiles:
    (tmp_path / "d.txt").write_text("alpha\n\nbeta gamma\n\ndelta")
    prepare([tmp_path / "d.txt"], tmp_path / "t", format="paragraphs")
    return DatasetFiles(tmp_path / "t")


def open_dataset(files: DatasetFiles, **fields) -> MemmapDataset:
    return MemmapDataset(MemmapDatasetConfig(path=str(files.prefix), **{"sequence_length": 4, **fields}), seed=0)


def edit_metadata(files: DatasetFiles, **changes) -> None:
    files.metadata.write_text(json.dumps({**json.loads(files.metadata.read_text()), **changes}))


def test_damaged_datasets_are_refused_with_the_reason(prepared):
    files = prepared
    open_dataset(files)  # intact
    tokens, index = files.tokens.read_bytes(), files.index.read_bytes()
    metadata = files.metadata.read_text()
    damages = [
        (lambda: files.tokens.write_bytes(tokens[:-2]), r"t\.bin is truncated: it holds 44 bytes, .*23 uint16 tokens"),
        (lambda: files.tokens.unlink(), r"the dataset is incomplete: .*t\.bin does not exist"),
        (lambda: files.index.write_bytes(index + bytes(8)), r"t\.idx is longer than its metadata says"),
        (lambda: files.index.write_bytes(index[:8] + index[16:24] + index[8:16] + index[24:]), "does not match"),
        (lambda: files.metadata.unlink(), r"no dataset at .*t\.json does not exist .*blockzoo prepare"),
        (lambda: files.metadata.write_text("{"), r"cannot read the dataset metadata .*t\.json"),
        (lambda: files.metadata.write_text("[]"), "is not a JSON object"),
        (lambda: edit_metadata(files, format="other"), "is not the metadata of a blockzoo dataset"),
        (lambda: edit_metadata(files, num_tokens="23"), "has no valid 'num_tokens'"),
        (lambda: edit_metadata(files, version=3), "format version 3; this blockzoo reads up to 2"),
        (lambda: edit_metadata(files, dtype="int8"), "unknown token dtype 'int8'"),
        (lambda: edit_metadata(files, num_documents=0), "the shards' num_documents do not add up"),
        (lambda: edit_metadata(files, num_documents=0, shards=[]), "no valid 'shards' list"),
        (
            lambda: edit_metadata(files, num_documents=0, shards=[{"name": "t", "num_documents": 0, "num_tokens": 23}]),
            "holds no documents",
        ),
        (
            lambda: edit_metadata(files, shards=[{"name": "../t", "num_documents": 3, "num_tokens": 23}]),
            "shard 0 is not",
        ),
        (
            lambda: edit_metadata(files, num_tokens=22, shards=[{"name": "t", "num_documents": 3, "num_tokens": 22}]),
            "is longer than its metadata says",
        ),
    ]
    for damage, message in damages:
        damage()
        with pytest.raises(UsageError, match=message):
            open_dataset(files)
        files.tokens.write_bytes(tokens)
        files.index.write_bytes(index)
        files.metadata.write_text(metadata)


def test_a_token_id_outside_the_vocabulary_is_reported_not_fed_to_the_model(prepared):
    files = prepared
    edit_metadata(files, vocab_size=100)  # the bytes of "alpha" are >= 97
    batches = open_dataset(files).training_batches()
    with pytest.raises(DatasetError, match=r"token id \d+ among tokens \[\d+, \d+\) is outside the vocabulary"):
        for _ in range(6):
            next(batches)


def test_splits_too_small_for_a_sequence_are_refused(prepared):
    with pytest.raises(DatasetError, match="holds 23 tokens, fewer than one sequence of 64"):
        open_dataset(prepared, sequence_length=64)
    with pytest.raises(DatasetError, match="none is left for training"):
        open_dataset(prepared, validation_fraction=0.9)
    with pytest.raises(DatasetError, match="the evaluation split holds 0 sequences"):
        open_dataset(prepared).evaluation_batches()
    with pytest.raises(DatasetError, match=r"holds 1 sequences of 4 tokens, fewer than one micro-batch on each of 2"):
        open_dataset(prepared, validation_fraction=0.3).evaluation_batches(ranks=2)
    with pytest.raises(DatasetError, match=r"no path: set data\.path"):
        MemmapDataset(MemmapDatasetConfig(), seed=0)


def test_the_dataset_decodes_with_the_tokenizer_it_was_prepared_with(prepared):
    dataset = open_dataset(prepared)
    assert dataset.tokenizer.decode(dataset.store.tokens[:12].tolist()) == "alphabeta g"


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizers


def test_the_byte_tokenizer_round_trips_utf8_and_leaves_out_the_end_of_document():
    tokenizer = load_tokenizer("byte")
    text = "Grüße, 世界! 🙂"
    assert tokenizer.encode(text) == list(text.encode("utf-8"))
    assert tokenizer.decode([*tokenizer.encode(text), EOD]) == text
    assert tokenizer.vocab_size == 257
    with pytest.raises(ValueError, match=r"token ids \[257\] are outside this tokenizer's vocabulary \[0, 257\)"):
        tokenizer.decode([65, 257])


@pytest.fixture
def word_tokenizer(tmp_path):
    """A tiny Hugging Face word-level tokenizer.json."""
    tokenizers = pytest.importorskip("tokenizers")
    vocabulary = {"[UNK]": 0, "<eos>": 1, "the": 2, "cat": 3, "sat": 4, "on": 5, "mat": 6, ".": 7}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.decoder = tokenizers.decoders.WordPiece()
    tokenizer.add_special_tokens([tokenizers.AddedToken("<eos>", special=True)])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    return tmp_path / "tokenizer.json"


def test_a_hugging_face_tokenizer_prepares_and_decodes(tmp_path, word_tokenizer):
    (tmp_path / "d.jsonl").write_text('{"text": "the cat sat on the mat."}\n{"text": "the dog sat."}\n')
    prefix = tmp_path / "out" / "t"
    run_prepare(str(tmp_path / "d.jsonl"), "--format", "jsonl", "--tokenizer", str(word_tokenizer),
                "--eod-token", "<eos>", "-o", str(prefix))  # fmt: skip
    assert stored_documents(prefix) == [[2, 3, 4, 5, 2, 6, 7, 1], [2, 0, 4, 7, 1]]
    metadata = json.loads(prefix.with_suffix(".json").read_text())
    assert (metadata["dtype"], metadata["vocab_size"], metadata["eod_token_id"]) == ("uint8", 8, 1)
    assert metadata["tokenizer"] == {"type": "huggingface", "eod_token": "<eos>"}
    word_tokenizer.unlink()  # the dataset keeps its own copy
    dataset = MemmapDataset(MemmapDatasetConfig(path=str(prefix), sequence_length=4), seed=0)
    assert dataset.tokenizer.decode([2, 3, 4, 1]) == "the cat sat"
    assert dataset.tokenizer.eod_token_id == 1
    assert torch.equal(dataset.store.tokens[:3].to(torch.int64), torch.tensor([2, 3, 4]))
    prepare([tmp_path / "d.jsonl"], prefix, format="jsonl")  # the same prefix again, with the byte tokenizer
    assert not prefix.with_suffix(".tokenizer.json").exists()


def test_bad_hugging_face_tokenizers_are_refused(tmp_path, word_tokenizer):
    broken = tmp_path / "broken.json"
    broken.write_text('{"model": 3}')
    with pytest.raises(DatasetError, match=r"cannot read the tokenizer .*broken\.json"):
        load_tokenizer(broken)
    with pytest.raises(DatasetError, match=r"token '</s>' is not in the vocabulary of .*tokenizer\.json"):
        load_tokenizer(word_tokenizer, eod_token="</s>")
    assert load_tokenizer(word_tokenizer.parent).vocab_size == 8  # a directory holding tokenizer.json


def test_a_dataset_of_format_version_1_still_loads(prepared):
    """Written before shards existed: one pair of files named after the prefix, no shard list in the metadata."""
    files = prepared
    metadata = json.loads(files.metadata.read_text())
    del metadata["shards"]
    files.metadata.write_text(json.dumps({**metadata, "version": 1}))
    assert stored_documents(files.prefix) == [byte_ids("alpha"), byte_ids("beta gamma"), byte_ids("delta")]
