"""What `blockzoo init` can write: run configs to start from, by name. Today the examples installed with the core
(`blockzoo/examples/*.yaml`, copies of the repository's `examples/`), then the named architectures the plugins ship
(`blockzoo models`: a run config for the preset, `blockzoo.preset_runs`); another source adds its starters in
`starters()`, after these, which keep their names. No torch is imported; the presets load the plugins."""

from __future__ import annotations

import functools
import importlib.resources
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from blockzoo.errors import UsageError

DEFAULT = "demo"


@dataclass(frozen=True)
class Starter:
    """A run config `blockzoo init NAME` writes: its text, read on demand, and one line saying what it is."""

    name: str
    description: str
    origin: str  # where it comes from, for `blockzoo init --list`: "example", ...
    read: Callable[[], str]


def starters() -> dict[str, Starter]:
    """Every starter by name, the installed examples first: a later source never replaces an earlier name."""
    found: dict[str, Starter] = {}
    for starter in [*_examples(), *_presets()]:
        found.setdefault(starter.name, starter)
    return found


def starter(name: str) -> Starter:
    found = starters()
    if name not in found:
        names = ", ".join(found)
        raise UsageError(f"no config named {name!r} to start from; there are: {names} (blockzoo init --list)")
    return found[name]


def write(name: str, output: Path, *, force: bool = False) -> Starter:
    """Write the starter `name` to `output`, refusing to replace an existing file unless `force`."""
    chosen = starter(name)
    if output.exists() and not force:
        raise UsageError(f"{output} exists; choose another --output, or --force to replace it")
    if not output.parent.is_dir():
        raise UsageError(f"the directory of --output {output} does not exist")
    text = chosen.read()
    # Written aside and renamed: an interrupted write never leaves a truncated config that looks complete.
    partial = output.with_name(output.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    partial.replace(output)
    return chosen


def _examples() -> list[Starter]:
    folder = importlib.resources.files("blockzoo") / "examples"
    found = []
    for entry in sorted(folder.iterdir(), key=lambda entry: entry.name):
        if entry.name.endswith(".yaml"):
            text = entry.read_text(encoding="utf-8")
            read = functools.partial(entry.read_text, encoding="utf-8")
            found.append(Starter(entry.name.removesuffix(".yaml"), _description(text), "example", read))
    return found


def _presets() -> list[Starter]:
    from blockzoo import preset_runs, presets

    return [
        Starter(
            entry.name,
            preset_runs.description(entry),
            "preset",
            functools.partial(preset_runs.run_config_text, entry.name),
        )
        for entry in presets.entries()
    ]


def _description(text: str) -> str:
    """The first sentence of the example's opening comment: each example opens by saying what it trains."""
    comment = []
    for line in text.splitlines():
        if not line.startswith("#") or line.startswith("#  "):  # the end of the prose: code, or a command
            break
        comment.append(line.removeprefix("#").strip())
    sentence = re.split(r"(?<=\.)\s", " ".join(comment), maxsplit=1)[0]
    return sentence.removesuffix(":")
