"""`blockzoo prepare` on real corpora: every input format against pyarrow / `datasets` reading the same files and
`tokenizers` encoding them; parallel and single-worker outputs identical; sharded datasets read as one stream; a
killed prepare; memory that does not grow with the corpus; bad inputs through the real CLI; `blockzoo data`."""

from __future__ import annotations

import gzip
import itertools
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from blockzoo.cli import main
from blockzoo.data import inputs
from blockzoo.data.config import MemmapDatasetConfig
from blockzoo.data.corpus import stories
from blockzoo.data.errors import DatasetError
from blockzoo.data.memmap import MemmapDataset
from blockzoo.data.prepare import prepare

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
tokenizers = pytest.importorskip("tokenizers")
EOD = "<|endoftext|>"


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    """A small byte-level BPE tokenizer.json trained here, with an end-of-document token."""
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=[EOD], initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    tokenizer.train_from_iterator(stories(200), trainer=trainer)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def reference_ids(bpe: Path, texts: list[str | None]) -> list[list[int]]:
    """`tokenizers` itself on the documents with text, the end-of-document id appended."""
    tokenizer = tokenizers.Tokenizer.from_file(str(bpe))
    kept = [text for text in texts if text and not text.isspace()]
    return [[*encoding.ids, tokenizer.token_to_id(EOD)] for encoding in tokenizer.encode_batch(kept)]


def stored_documents(prefix: Path) -> list[list[int]]:
    store = MemmapDataset(MemmapDatasetConfig(path=str(prefix), sequence_length=1), seed=0).store
    return [store.tokens[a:b].tolist() for a, b in itertools.pairwise(store.offsets.tolist())]


def prepare_bpe(inputs_: list, prefix: Path, bpe: Path, **options) -> dict:
    return prepare(inputs_, prefix, tokenizer=bpe, eod_token=EOD, workers=options.pop("workers", 1), **options)


def documents(count: int, start: int = 0) -> list[str | None]:
    """Stories, with an empty, a blank and (for columnar files) a null row among them: those are skipped."""
    texts: list[str | None] = list(stories(start + count)[start:])
    texts[1:1] = ["", "  \n", None]
    return texts


# ---------------------------------------------------------------------------------------------------------------------
# Each format against its own library


def test_a_parquet_directory_reads_as_datasets_reads_it(tmp_path, bpe):
    datasets = pytest.importorskip("datasets")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for number in range(3):
        texts = documents(20, start=20 * number)
        table = pa.table({"id": list(range(len(texts))), "content": texts})
        pq.write_table(table, corpus / f"part-{number}.parquet", row_group_size=7)
    (corpus / "README.txt").write_text("not read: --format parquet takes the Parquet files of a directory")
    metadata = prepare_bpe([corpus], tmp_path / "t", bpe, format="parquet", field="content")

    files = sorted(str(path) for path in corpus.glob("*.parquet"))
    loaded = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=str(tmp_path / "cache"))
    assert stored_documents(tmp_path / "t") == reference_ids(bpe, loaded["content"])
    assert metadata["sources"] == files
    assert (metadata["vocab_size"], metadata["dtype"]) == (400, "uint16")


def test_a_saved_datasets_directory_reads_as_load_from_disk(tmp_path, bpe):
    datasets = pytest.importorskip("datasets")
    texts = documents(40)
    datasets.Dataset.from_dict({"text": texts, "n": list(range(len(texts)))}).save_to_disk(
        str(tmp_path / "saved"), num_shards=3
    )
    assert len(list((tmp_path / "saved").glob("*.arrow"))) == 3
    prepare_bpe([tmp_path / "saved"], tmp_path / "t", bpe)  # auto: recognised by its state.json
    reloaded = datasets.load_from_disk(str(tmp_path / "saved"))
    assert stored_documents(tmp_path / "t") == reference_ids(bpe, reloaded["text"])


@pytest.mark.parametrize("kind", ["file", "stream"])
def test_arrow_ipc_files_and_streams_read_as_pyarrow_reads_them(tmp_path, bpe, kind):
    texts = documents(30)
    schema = pa.schema([("text", pa.large_string())])
    path = tmp_path / "data.arrow"
    with (pa.ipc.new_file if kind == "file" else pa.ipc.new_stream)(str(path), schema) as writer:
        for start in range(0, len(texts), 8):  # several record batches
            writer.write_batch(pa.record_batch([pa.array(texts[start : start + 8], pa.large_string())], schema))
    prepare_bpe([path], tmp_path / "t", bpe)
    read = (pa.ipc.open_file if kind == "file" else pa.ipc.open_stream)(str(path)).read_all()
    assert stored_documents(tmp_path / "t") == reference_ids(bpe, read.column("text").to_pylist())


def test_compressed_jsonl_reads_as_the_plain_file(tmp_path, bpe):
    zstandard = pytest.importorskip("zstandard")
    texts = [text for text in documents(25) if text is not None]
    plain = "".join(json.dumps({"body": text}) + "\n" for text in texts).encode()
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(plain))
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(plain))
    expected = reference_ids(bpe, [json.loads(line)["body"] for line in plain.decode().splitlines()])
    for name in ("a.jsonl.gz", "b.jsonl.zst"):
        prepare_bpe([tmp_path / name], tmp_path / "t", bpe, field="body")
        assert stored_documents(tmp_path / "t") == expected, name


def test_directories_and_quoted_globs_expand_sorted_with_formats_by_name(tmp_path, bpe):
    (tmp_path / "in" / "sub").mkdir(parents=True)
    (tmp_path / "in" / "b.txt").write_text("second file")
    (tmp_path / "in" / "a.jsonl").write_text('{"text": "first"}\n')
    (tmp_path / "in" / "sub" / "c.parquet").write_bytes(b"")  # replaced below
    pq.write_table(pa.table({"text": ["third"]}), tmp_path / "in" / "sub" / "c.parquet")
    (tmp_path / "in" / ".hidden.txt").write_text("skipped")
    (tmp_path / "in" / "notes.csv").write_text("skipped: not a recognised kind")
    found = inputs.resolve_inputs([tmp_path / "in"])
    assert [(file.path.name, file.format) for file in found] == [
        ("a.jsonl", "jsonl"), ("b.txt", "text"), ("c.parquet", "parquet"),
    ]  # fmt: skip
    globbed = inputs.resolve_inputs([str(tmp_path / "in" / "**" / "*.parquet"), str(tmp_path / "in" / "*.txt")])
    assert [file.path.name for file in globbed] == ["c.parquet", "b.txt"]
    prepare_bpe([tmp_path / "in"], tmp_path / "t", bpe)
    assert stored_documents(tmp_path / "t") == reference_ids(bpe, ["first", "second file", "third"])


# ---------------------------------------------------------------------------------------------------------------------
# Parallel, sharded, killed


def mixed_corpus(directory: Path, count: int = 60) -> list[str]:
    """A corpus of every splittable kind (Parquet row groups, Arrow file batches, JSONL lines); its texts in order."""
    directory.mkdir(parents=True, exist_ok=True)
    texts = list(stories(3 * count))
    pq.write_table(pa.table({"text": texts[:count]}), directory / "a.parquet", row_group_size=5)
    schema = pa.schema([("text", pa.string())])
    with pa.ipc.new_file(str(directory / "b.arrow"), schema) as writer:
        for start in range(count, 2 * count, 6):
            writer.write_batch(pa.record_batch([pa.array(texts[start : min(start + 6, 2 * count)])], schema))
    (directory / "c.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts[2 * count :]))
    return texts


def test_parallel_and_single_worker_outputs_are_identical_shards_read_as_one_stream(tmp_path, bpe, monkeypatch):
    texts = mixed_corpus(tmp_path / "in")
    monkeypatch.setattr(inputs, "UNIT_BYTES", 6000)  # many small units: every kind is cut
    units = inputs.plan_units(inputs.resolve_inputs([tmp_path / "in"]))
    assert {piece.file.path.suffix for unit in units for piece in unit.pieces if piece.span} == {
        ".parquet", ".arrow", ".jsonl"
    }  # fmt: skip
    one = prepare_bpe([tmp_path / "in"], tmp_path / "one" / "t", bpe, workers=1)
    two = prepare_bpe([tmp_path / "in"], tmp_path / "two" / "t", bpe, workers=2)
    assert one == two and len(one["shards"]) > 10  # (a unit may hold no document: no shard)
    for shard in one["shards"]:
        for suffix in (".bin", ".idx"):
            name = shard["name"] + suffix
            assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    expected = reference_ids(bpe, texts)
    assert stored_documents(tmp_path / "two" / "t") == expected

    # The sharded dataset gives the batches of the same documents prepared as one shard.
    monkeypatch.setattr(inputs, "UNIT_BYTES", 1 << 30)
    assert len(prepare_bpe([tmp_path / "in"], tmp_path / "whole" / "t", bpe)["shards"]) == 1
    batches = [
        MemmapDataset(MemmapDatasetConfig(path=str(path), sequence_length=50, micro_batch_size=3), seed=1)
        for path in (tmp_path / "two" / "t", tmp_path / "whole" / "t")
    ]
    streams = [dataset.training_batches() for dataset in batches]
    for _ in range(20):
        sharded, whole = (next(stream) for stream in streams)
        assert sharded.tokens.tolist() == whole.tokens.tolist()
        assert sharded.lengths.tolist() == whole.lengths.tolist()


KILLABLE = """
import sys
from blockzoo.data import inputs
from blockzoo.data.prepare import prepare
inputs.UNIT_BYTES = 20_000
prepare([sys.argv[1]], sys.argv[2], workers=1)
"""


def test_a_killed_prepare_leaves_no_dataset_that_looks_complete_and_a_rerun_succeeds(tmp_path):
    corpus = tmp_path / "in.jsonl"
    texts = list(stories(3000))
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    prefix = tmp_path / "out" / "t"
    for previous in ("none", "complete"):
        if previous == "complete":
            (tmp_path / "small.txt").write_text("old")
            prepare([tmp_path / "small.txt"], prefix)
        process = subprocess.Popen([sys.executable, "-c", KILLABLE, str(corpus), str(prefix)])
        deadline = time.monotonic() + 60
        while not list((tmp_path / "out").glob(".t.*.tmp")) and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
        assert process.wait() == -signal.SIGKILL
        left = sorted(path.name for path in (tmp_path / "out").iterdir())
        assert any(name.endswith(".tmp") for name in left), left  # killed mid-way
        if previous == "none":
            with pytest.raises(DatasetError, match=r"no dataset at .*t\.json does not exist"):
                stored_documents(prefix)
        else:  # the older dataset is still whole, still read
            assert stored_documents(prefix) == [[*b"old", 256]]
        metadata = prepare([corpus], prefix, workers=2)
        assert stored_documents(prefix) == [[*text.encode(), 256] for text in texts]
        names = sorted(path.name for path in (tmp_path / "out").iterdir())
        assert names == sorted(["t.json", *(f"{shard['name']}{suffix}" for shard in metadata["shards"]
                                            for suffix in (".bin", ".idx"))])  # fmt: skip


MEASURE = """
import sys
from blockzoo.data.prepare import prepare
prepare([sys.argv[1]], sys.argv[2], workers=1)
with open("/proc/self/status") as status:
    print(next(int(line.split()[1]) for line in status if line.startswith("VmHWM")))
"""


def peak_rss_mib(tmp_path: Path, rows: int) -> float:
    """The peak RSS of a process preparing a Parquet file of `rows` rows of about 1 KB (written in row groups of
    1000)."""
    directory = tmp_path / str(rows)
    directory.mkdir()
    row = ("All work and no play makes a dull model. " * 25).strip()
    with pq.ParquetWriter(directory / "corpus.parquet", pa.schema([("text", pa.string())])) as writer:
        for _ in range(rows // 1000):
            writer.write_table(pa.table({"text": [row] * 1000}))
    command = [sys.executable, "-c", MEASURE, str(directory / "corpus.parquet"), str(directory / "t")]
    result = subprocess.run(command, capture_output=True, text=True, check=True, timeout=600)
    return int(result.stdout.split()[-1]) / 1024


def check_flat_memory(tmp_path: Path, rows: int) -> None:
    """Peak RSS of a prepare of `rows` rows (~1 KB each, streamed) and of 4x as many: it does not grow with them."""
    small, large = peak_rss_mib(tmp_path, rows), peak_rss_mib(tmp_path, 4 * rows)
    corpus_growth_mib = 3 * rows * 1024 / 2**20
    print(
        f"peak RSS: {small:.0f} MiB for {rows} rows, {large:.0f} MiB for {4 * rows} (+{corpus_growth_mib:.0f} MiB text)"
    )
    assert large - small < max(8.0, 0.1 * corpus_growth_mib)


def test_memory_does_not_grow_with_the_corpus(tmp_path):
    check_flat_memory(tmp_path, 8_000)


@pytest.mark.slow
def test_memory_does_not_grow_with_a_large_corpus(tmp_path):
    check_flat_memory(tmp_path, 100_000)


# ---------------------------------------------------------------------------------------------------------------------
# Bad inputs, through the CLI


def cli(capsys, *arguments: str) -> tuple[int, str, str]:
    code = main([*map(str, arguments)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_bad_inputs_are_named_with_exit_code_2_and_nothing_left(tmp_path, capsys, monkeypatch):
    pq.write_table(pa.table({"text": [f"document {i}" for i in range(2000)], "n": list(range(2000))}),
                   tmp_path / "good.parquet")  # fmt: skip
    data = (tmp_path / "good.parquet").read_bytes()
    (tmp_path / "truncated.parquet").write_bytes(data[: len(data) // 2])
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "a.zst").mkdir()
    (tmp_path / "a.zst" / "x.jsonl.zst").write_bytes(b"")
    (tmp_path / "notes.csv").write_text("a,b")
    out = tmp_path / "out" / "t"
    cases = [
        ([tmp_path / "truncated.parquet"], r"truncated\.parquet is not a readable Parquet file"),
        ([tmp_path / "good.parquet", "--field", "body"],
         r"good\.parquet has no column 'body' \(its columns: 'text', 'n'\)"),
        ([tmp_path / "good.parquet", "--field", "n"], r"good\.parquet: column 'n' holds int64, expected strings"),
        ([tmp_path / "missing.parquet"], r"input .*missing\.parquet does not exist"),
        ([tmp_path / "*.arrow"], r"the pattern '.*\*\.arrow' matches no files"),
        ([tmp_path / "empty.jsonl"], r"the corpus is empty: .*empty\.jsonl hold no document with text"),
        ([tmp_path / "notes.csv"], r"cannot tell the format of .*notes\.csv from its name .*give --format"),
        ([tmp_path / "good.parquet", "--format", "datasets"], r"good\.parquet is a file; --format datasets reads"),
        ([tmp_path / "good.parquet", "--workers", "0"], "--workers must be at least 1, got 0"),
    ]  # fmt: skip
    for arguments, message in cases:
        code, _, stderr = cli(capsys, "prepare", "--workers", "2", *arguments, "-o", out)
        assert code == 2, (arguments, stderr)
        assert re.search(message, stderr), (message, stderr)
        assert stderr.startswith("blockzoo: error: ") and "Traceback" not in stderr
        assert not (out.parent.exists() and list(out.parent.iterdir())), list(out.parent.iterdir())

    code, _, stderr = cli(capsys, "prepare", tmp_path / "good.parquet", "-o", out, "--format", "csv")
    assert code == 2 and re.search(r"unknown input format 'csv' .*available: arrow, datasets, jsonl", stderr), stderr
    assert not out.parent.exists() or not list(out.parent.iterdir())


def test_a_jsonl_error_in_a_later_piece_names_its_line_in_the_file(tmp_path, monkeypatch):
    lines = [json.dumps({"text": f"line {number}"}) for number in range(1, 400)]
    lines[300] = '{"text": 3}'
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(inputs, "UNIT_BYTES", 1000)
    with pytest.raises(DatasetError, match=r"d\.jsonl line 301: field 'text' holds int, expected a string"):
        prepare([tmp_path / "d.jsonl"], tmp_path / "t", workers=1)


# ---------------------------------------------------------------------------------------------------------------------
# blockzoo data


def test_data_describes_a_prepared_dataset(tmp_path, capsys, bpe):
    mixed_corpus(tmp_path / "in", count=10)
    prepare_bpe([tmp_path / "in"], tmp_path / "t", bpe)
    code, stdout, _ = cli(capsys, "data", tmp_path / "t", "--samples", "2", "--characters", "40")
    metadata = json.loads((tmp_path / "t.json").read_text())
    assert code == 0
    assert f"documents  {metadata['num_documents']:,}" in stdout
    assert f"tokens     {metadata['num_tokens']:,}" in stdout
    assert f"tokenizer  Hugging Face {tmp_path / 't.tokenizer.json'}, end of document '{EOD}'" in stdout
    assert "vocabulary 400 ids, end-of-document id 0" in stdout and "dtype      uint16" in stdout
    assert "shards     1\n  t.bin/.idx: 30 documents" in stdout
    assert all(str(tmp_path / "in" / name) in stdout for name in ("a.parquet", "b.arrow", "c.jsonl"))
    first = stories(1)[0]
    assert f"document 0 ({len(reference_ids(bpe, [first])[0])} tokens): {first[:40] + ' [...]'!r}" in stdout
    assert "document 1 " in stdout and "document 2 " not in stdout

    (tmp_path / "t.bin").write_bytes(b"12")
    code, _, stderr = cli(capsys, "data", tmp_path / "t")
    assert code == 2 and re.search(r"t\.bin is truncated", stderr)
    code, _, stderr = cli(capsys, "data", tmp_path / "none")
    assert code == 2 and re.search(r"no dataset at .*none\.json does not exist", stderr)
