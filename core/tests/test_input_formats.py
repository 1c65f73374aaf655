"""`blockzoo prepare`'s input formats as registered kinds: the core's own (text, paragraphs, JSONL, .gz) read with
no plugin, against json/gzip reading the same files; a format or compression of blockzoo-corpora, when it is not
installed, named with what to install (exit code 2, nothing written)."""

from __future__ import annotations

import gzip
import itertools
import json
import subprocess
import sys

import pytest

from blockzoo import plugins
from blockzoo.cli import main
from blockzoo.data import inputs
from blockzoo.data.prepare import prepare
from blockzoo.data.storage import DatasetFiles


@pytest.fixture
def core_only_registry(monkeypatch):
    """The core's own plugin only: blockzoo-corpora as if it were not installed."""
    monkeypatch.setattr(plugins, "_registry", plugins.discover({"BLOCKZOO_PLUGINS": ""}))


def stored_documents(prefix) -> list[bytes]:
    """The prepared byte-tokenized documents, read back from the token and offset files without the dataset code."""
    import numpy

    metadata = json.loads(DatasetFiles(prefix).metadata.read_text())
    documents: list[bytes] = []
    for shard in metadata["shards"]:
        tokens = numpy.fromfile(prefix.parent / f"{shard['name']}.bin", dtype=metadata["dtype"])
        offsets = numpy.fromfile(prefix.parent / f"{shard['name']}.idx", dtype=numpy.int64)
        documents += [bytes(tokens[a : b - 1].tolist()) for a, b in itertools.pairwise(offsets)]
    return documents


def test_the_core_formats_are_registered_and_read_without_a_plugin(tmp_path, core_only_registry):
    assert plugins.get_registry().available("input_format") == ["jsonl", "paragraphs", "text"]
    assert plugins.get_registry().available("input_compression") == ["gz"]
    records = [{"text": "first"}, {"text": "  "}, {"text": "second\\nline"}]
    plain = "".join(json.dumps(record) + "\n" for record in records).encode()
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl.gz").write_bytes(gzip.compress(plain))
    (tmp_path / "in" / "b.txt").write_text("a whole file\n\nis one document")
    (tmp_path / "p.md").write_text("one\nparagraph\n\n  \nanother")
    found = inputs.resolve_inputs([tmp_path / "in"])
    assert [(file.path.name, file.format, file.compressed) for file in found] == [
        ("a.jsonl.gz", "jsonl", True), ("b.txt", "text", False),
    ]  # fmt: skip
    prepare([tmp_path / "in"], tmp_path / "t", workers=1)
    lines = gzip.decompress((tmp_path / "in" / "a.jsonl.gz").read_bytes()).decode().splitlines()
    expected = [json.loads(line)["text"] for line in lines]
    expected = [text for text in expected if text.strip()] + ["a whole file\n\nis one document"]
    assert stored_documents(tmp_path / "t") == [text.encode() for text in expected]
    prepare([tmp_path / "p.md"], tmp_path / "p", format="paragraphs", workers=1)
    assert stored_documents(tmp_path / "p") == [b"one\nparagraph", b"another"]


def test_a_format_of_a_missing_plugin_is_named_with_what_to_install(tmp_path, capsys, core_only_registry):
    (tmp_path / "a.parquet").write_bytes(b"PAR1")
    (tmp_path / "b.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    (tmp_path / "c.jsonl").write_text('{"text": "x"}\n')
    out = tmp_path / "out" / "t"
    install = "provided by blockzoo-corpora: pip install blockzoo-corpora"
    for arguments, message in [
        ([tmp_path / "a.parquet"], f"reading {tmp_path / 'a.parquet'} needs the input format 'parquet', {install}"),
        ([tmp_path], f"needs the input format 'parquet', {install}"),  # found walking a directory
        ([tmp_path / "b.jsonl.zst"], f"needs the input compression 'zst', {install}"),
        ([tmp_path / "c.jsonl", "--format", "arrow"], f"--format arrow: the input format 'arrow' is {install}"),
        ([tmp_path / "c.jsonl", "--format", "csv"], "unknown input format 'csv' (available: jsonl, paragraphs, text)"),
    ]:
        code = main(["prepare", *map(str, arguments), "-o", str(out), "--workers", "1"])
        stderr = capsys.readouterr().err
        assert code == 2 and message in stderr and "Traceback" not in stderr, (arguments, stderr)
        assert not out.parent.exists()


def test_prepare_imports_no_torch(tmp_path):
    (tmp_path / "d.txt").write_text("text")
    probe = f"import sys; from blockzoo.data.prepare import prepare; prepare([{str(tmp_path / 'd.txt')!r}], "
    probe += f"{str(tmp_path / 't')!r}); print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip() == "False"
