"""`blockzoo init`: the examples installed with the core, written where the user asks, and `blockzoo train`
without a config pointing at it."""

from pathlib import Path

import pytest
import yaml

from blockzoo.cli import main
from blockzoo.config import load
from blockzoo.run_config import RunConfig
from blockzoo.starters import starters

REPOSITORY_EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# Examples of the repository that are not installed, and why: they need a file only the repository has.
NOT_INSTALLED = {"blended": "its data are made by examples/blended_data.py"}


def test_installed_examples_are_the_repositorys():
    installed = {name: entry.read() for name, entry in starters().items() if entry.origin == "example"}
    repository = {path.stem: path.read_text(encoding="utf-8") for path in REPOSITORY_EXAMPLES.glob("*.yaml")}
    assert set(installed) == set(repository) - set(NOT_INSTALLED), (
        "core/src/blockzoo/examples/ must hold a copy of every examples/*.yaml but "
        f"{sorted(NOT_INSTALLED)}: copy the missing ones, or list why they stay out"
    )
    for name, text in installed.items():
        assert text == repository[name], f"core/src/blockzoo/examples/{name}.yaml differs from examples/{name}.yaml"


def test_every_starter_says_what_it_is():
    for entry in starters().values():
        assert entry.description and "\n" not in entry.description, entry.name


def test_init_writes_the_demo_by_default(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["init"]) == 0
    written = tmp_path / "demo.yaml"
    assert written.read_text(encoding="utf-8") == (REPOSITORY_EXAMPLES / "demo.yaml").read_text(encoding="utf-8")
    assert "blockzoo train demo.yaml" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.partial"))


def test_init_writes_a_config_the_core_loads(tmp_path):
    output = tmp_path / "start.yaml"
    assert main(["init", "run", "--output", str(output)]) == 0
    config = load(RunConfig, output, [])
    assert config.data.sequence_length == yaml.safe_load(output.read_text())["data"]["sequence_length"]


def test_init_refuses_to_replace_a_file_unless_forced(tmp_path, capsys):
    output = tmp_path / "mine.yaml"
    output.write_text("kept: true\n")
    assert main(["init", "moe", "-o", str(output)]) == 2
    assert f"{output} exists" in capsys.readouterr().err and output.read_text() == "kept: true\n"
    assert main(["init", "moe", "-o", str(output), "--force"]) == 0
    assert output.read_text() == (REPOSITORY_EXAMPLES / "moe.yaml").read_text()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["init", "nope"], "no config named 'nope' to start from; there are: demo, "),
        (["init", "demo", "-o", "missing/dir/demo.yaml"], "the directory of --output missing/dir/demo.yaml"),
        (["train"], "`blockzoo init` writes demo.yaml"),
    ],
)
def test_bad_uses_say_what_to_do(arguments, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(arguments) == 2
    error = capsys.readouterr().err
    assert message in error and "Traceback" not in error
    assert not list(tmp_path.iterdir())


def test_init_list_names_every_starter(capsys):
    assert main(["init", "--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == list(starters()) and "demo" in listed
