"""docs/python-api.md is a program: its Python snippets, run in order in one namespace (in a fresh directory, as a
reader runs them), assemble a hybrid from typed configs, train it with the Trainer, save, load, export and generate."""

import re
from pathlib import Path

import pytest

DOC = Path(__file__).parents[1] / "docs" / "python-api.md"


def snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)


def test_the_guide_has_its_snippets():
    assert len(snippets()) == 4


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_every_snippet_of_the_guide_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for number, code in enumerate(snippets(), start=1):
        exec(compile(code, f"{DOC.name} snippet {number}", "exec"), namespace)
    assert (tmp_path / "runs" / "python" / "metrics.jsonl").is_file()
    assert (tmp_path / "checkpoints" / "hybrid_hf" / "tokenizer.json").is_file()
    assert capsys.readouterr().out.splitlines()[-1].startswith("Once upon a time")
