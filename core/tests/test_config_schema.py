"""`blockzoo config schema`: the config reference generated from the config classes of the core and of every
plugin (here the core and an in-process plugin), as markdown whose every link lands on a heading; torch-free."""

import re
import subprocess
import sys
from typing import ClassVar, Literal

import pytest

from blockzoo.api import (
    TENSOR_PARALLEL,
    Config,
    LinearConfig,
    MixerConfig,
    NormalizationConfig,
    at_least,
    configclass,
    field,
    hookimpl,
)
from blockzoo.cli import main
from blockzoo.plugins import register_plugin
from blockzoo.schema import config_reference


@configclass
class WindowConfig(Config):
    """Where each token looks."""

    size: int = field(4, doc="Tokens seen.")


@configclass
class ProbeConfig(MixerConfig):
    """A mixer that exists only in this test."""

    capabilities: ClassVar[frozenset[str]] = frozenset({TENSOR_PARALLEL})

    width: int = field(8, doc="How wide | how far.", validator=at_least(1))
    mode: Literal["fast", "exact"] = field("exact", doc="How it computes.")
    scale: float | None = field(None, doc="None: derived.")
    projection: LinearConfig = field(factory=LinearConfig, doc="The projection.")
    window: WindowConfig = field(factory=WindowConfig, doc="The window.")
    norm: NormalizationConfig | None = field(None, doc="An optional norm.")


class ProbePlugin:
    @hookimpl
    def register_mixers(self, register):
        register("probe.mixer", ProbeConfig)


@pytest.fixture
def reference(core_only_registry) -> str:
    register_plugin(ProbePlugin(), "probe")
    return config_reference()


def test_every_kind_and_type_has_its_section(reference):
    assert reference.startswith("# Config reference\n")
    assert "`blockzoo config schema > docs/config-reference.md`" in reference
    for heading in ["### `RunConfig`", "### `LinearConfig`", "### `WindowConfig`", "### Kind `mixer`"]:
        assert f"\n{heading}\n" in reference
    for kind, name in [
        ("mixer", "none"),
        ("mixer", "probe.mixer"),
        ("normalization", "rms_norm"),
        ("block", "decoder"),
    ]:
        assert f"\n#### {kind} `{name}`\n" in reference


def test_a_plugin_type_lists_its_origin_capabilities_and_fields(reference):
    section = reference.split("#### mixer `probe.mixer`\n")[1].split("\n#")[0]
    assert "From plugin `probe` (registered in-process). A mixer that exists only in this test." in section
    assert "Capabilities: tensor_parallel." in section
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert rows == [
        "| `width` | int | `8` | How wide \\| how far. |",
        "| `mode` | `fast` \\| `exact` | `exact` | How it computes. |",
        "| `scale` | float \\| null | `null` | None: derived. |",
        "| `projection` | [LinearConfig](#linearconfig) | `{}` | The projection. |",
        "| `window` | [WindowConfig](#windowconfig) | `{}` | The window. |",
        "| `norm` | [normalization](#kind-normalization) \\| null | `null` | An optional norm. |",
    ]


def test_every_link_lands_on_a_heading(reference):
    # GitHub's anchors: lowercase, punctuation dropped (but - and _), spaces as hyphens.
    anchors = {
        re.sub(r"[^a-z0-9 _-]", "", heading.lower()).replace(" ", "-")
        for heading in re.findall(r"^#+ (.+)$", reference, flags=re.MULTILINE)
    }
    links = set(re.findall(r"\]\(#([^)]+)\)", reference))
    assert links and links <= anchors, links - anchors


def test_the_command_prints_it(reference, capsys):
    assert main(["config", "schema"]) == 0
    assert capsys.readouterr().out == reference
    assert main(["config", "schema", "model.hidden_size=8"]) == 2
    assert "`blockzoo config schema` takes no overrides" in capsys.readouterr().err


def test_the_reference_needs_no_torch():
    code = (
        "import sys, contextlib, io\n"
        "from blockzoo.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['config', 'schema']) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
