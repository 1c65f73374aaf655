"""The maintainers' matrix: `nox -s tests` runs `tests(all)` (every distribution together) and
`tests(<distribution>)` (each alone with the core); `nox -s lint`; `nox -s template` bakes the plugin template and
runs the generated project's tests; `nox -s dist` builds, checks and installs what a release publishes; `nox -s docs`
builds the documentation site. Sessions install from the repository's paths, never from an index (but third-party
requirements)."""

import functools
import os
import re
import shlex
import shutil
import tempfile
from pathlib import Path

import nox

ROOT = Path(__file__).parent
# Installed first: a bare `torch` requirement would pull a multi-GB CUDA build where none is installed.
TORCH = "torch==2.13.0"
TEST_REQUIREMENTS = ["pytest>=8", "pytest-xdist>=3", "setuptools>=61"]
# The benchmarks' torchtitan peer (tests/test_benchmarks.py runs it at --tiny shapes): torchtitan without its declared
# dependencies (datasets < 4.8, wandb, tensorboard... which its model code never imports) plus what that code imports;
# torchao for its float8 converter. The same pins as benchmarks/make_wheels.sh.
BENCHMARK_PEERS = ["torchtitan==0.3.0", "spmd_types==0.2.3", "torch_checkpointing==0.1.1", "torchao==0.18.0"]
DISTRIBUTION_FOLDERS = [
    "core",
    "libraries/*",
    "mixers/*",
    "adapters/*",
    "mlps/*",
    "converters/*",
    "trackers/*",
    "evaluation/*",
    "plugins/examples/*",
]

nox.options.sessions = ["lint", "tests"]
# The distributions of the demo, installed together (examples/moe.yaml also runs there).
DEMO_FOLDERS = [
    Path("core"),
    Path("mixers/attention"),
    Path("mixers/mamba_2"),
    Path("mixers/gated_delta_net"),
    Path("mixers/mla"),
    Path("mlps/mlp"),
    Path("mlps/moe"),
]
nox.options.reuse_venv = "yes"


def distributions() -> dict[str, Path]:
    """Distribution name -> folder, for every folder of the layout that holds a pyproject.toml."""
    found = {}
    for pattern in DISTRIBUTION_FOLDERS:
        for pyproject in sorted(ROOT.glob(f"{pattern}/pyproject.toml")):
            found[nox.project.load_toml(pyproject)["project"]["name"]] = pyproject.parent.relative_to(ROOT)
    return found


def install(session: nox.Session, *folders: Path, extra: str | None = "test") -> None:
    """torch first, then each folder editable, with its `extra` where its pyproject.toml declares one, and the
    folders of the repository's distributions they require (blockzoo-ssm, blockzoo-testing): from here, never the
    index."""
    session.install(TORCH)
    session.install(*TEST_REQUIREMENTS)
    arguments = []
    for folder in with_local_requirements(folders, extra):
        extras = nox.project.load_toml(folder / "pyproject.toml")["project"].get("optional-dependencies", {})
        arguments += ["-e", f"{folder}[{extra}]" if extra in extras else str(folder)]
    session.install(*arguments)


def with_local_requirements(folders, extra: str | None) -> list[Path]:
    """`folders` and, transitively, the folders of the repository's distributions they require (their dependencies
    and their `extra`'s): pip would look a requirement up on the index unless its folder is installed with them."""
    by_name = {re.sub(r"[-_.]+", "-", name).lower(): folder for name, folder in distributions().items()}
    found = list(dict.fromkeys(map(Path, folders)))
    for folder in found:  # grows while it is walked: requirements of requirements
        project = nox.project.load_toml(ROOT / folder / "pyproject.toml")["project"]
        lines = [*project.get("dependencies", []), *project.get("optional-dependencies", {}).get(extra, [])]
        for line in lines:
            name = re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", line).group()).lower()
            if name in by_name and by_name[name] not in found:
                found.append(by_name[name])
    return found


def discarded_on_ci(function):
    """Where CI is set, the session's environment is deleted once the session has run: CI makes every environment
    anew in a fresh clone, and twenty-odd of them, each with torch, would fill a small disk."""

    @functools.wraps(function)
    def session_then_discard(session: nox.Session, *args, **kwargs):
        try:
            function(session, *args, **kwargs)
        finally:
            location = getattr(session.virtualenv, "location", None)
            if os.environ.get("CI") and location:
                shutil.rmtree(location, ignore_errors=True)

    return session_then_discard


@nox.session
@nox.parametrize("distribution", [nox.param(name, id=name) for name in ["all", *distributions()]])
@discarded_on_ci
def tests(session: nox.Session, distribution: str) -> None:
    """`tests(all)`: every distribution installed together, every test. `tests(<distribution>)`: that
    distribution with the core and nothing else, its own tests but those marked `slow` or `distributed` (they ran
    in `tests(all)` and import nothing the fast ones do not): proves it declares what it needs, within CI's time.
    `nox -s tests` runs them all. Tests marked `gpu` skip where CUDA is absent."""
    selection = []
    if distribution == "all":
        folders = list(distributions().values())
        paths = [str(folder / "tests") for folder in [*folders, Path()] if (folder / "tests").is_dir()]
    else:
        selection = ["-m", "not slow and not distributed"]
        folder = distributions()[distribution]
        # A distribution whose tests need other local distributions (the converters need the layers they convert)
        # names their folders in its pyproject.toml: [tool.blockzoo] test-with = ["mixers/attention", ...].
        test_with = nox.project.load_toml(folder / "pyproject.toml").get("tool", {}).get("blockzoo", {})
        folders = list(dict.fromkeys([Path("core"), *map(Path, test_with.get("test-with", [])), folder]))
        paths = [str(folder / "tests")]
    install(session, *folders)
    if distribution == "all":  # the root tests/ (the benchmarks' among them) run here only
        session.install("--no-deps", *BENCHMARK_PEERS)
        session.install("tyro==1.0.17")
    session.run("pytest", "-n", "auto", *paths, *selection, *session.posargs, env={"BLOCKZOO_STRICT_PLUGINS": "1"})


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: train a small transformer on the embedded corpus (about two minutes on 2 CPU cores), then
    reload its checkpoint and continue a prompt. `nox -s demo -- moe` (or `-- hybrid`) does the same with
    examples/moe.yaml (examples/hybrid.yaml: attention + Mamba 2; `-- gated_delta_net`: Gated DeltaNet + attention;
    `-- mla`: Mamba 2 + multi-head latent attention with MoE; `-- blended`: three sources made and prepared by
    examples/blended_data.py into data/blended, blended, a validation set per source)."""
    install(session, *DEMO_FOLDERS, extra=None)
    example = session.posargs[0] if session.posargs else "demo"
    if example == "blended":  # its data: Parquet, .jsonl.zst and text sources, a trained tokenizer.json, prepared
        install(session, Path("libraries/corpora"), extra=None)
        session.install("tokenizers")
        session.run("python", "examples/blended_data.py")
    output = f"runs/{example}"  # the example's own output_dir, where the README's next commands look
    session.run("rm", "-rf", output, external=True)  # the demo trains anew
    session.run("blockzoo", "train", f"examples/{example}.yaml", f"training.output_dir={output}")
    session.run("blockzoo", "generate", output, "--prompt", "Once upon a time", "--max-new-tokens", "300")
    session.log(f"the run is in {output}: `blockzoo generate {output} --prompt ...`, `blockzoo plot {output}`")


@nox.session
@discarded_on_ci
def template(session: nox.Session) -> None:
    """Bake the plugin template (plugins/template) once per kind into a temporary directory outside the repository,
    install each project with the core into this session's environment, and run its tests: a generated project passes
    them right away."""
    # The generated projects' `test` extra names blockzoo-testing: installed here from its folder, never the index.
    install(session, Path("core"), Path("libraries/testing"), extra=None)
    session.install("copier>=9")
    root = Path(tempfile.mkdtemp(prefix="blockzoo-template-"))
    kinds = ("mixer", "mlp", "tracker")
    try:
        for kind in kinds:
            project = root / kind
            answers = ["--data", f"plugin_name=template_{kind}", "--data", f"kind={kind}"]
            session.run(
                "copier", "copy", "--defaults", "--quiet", *answers, str(ROOT / "plugins" / "template"), str(project)
            )
            session.install(f"{project}[test]")  # as a user installs it (not editable)
            with session.chdir(project):
                session.run("pytest", "-n", "auto", "tests", *session.posargs, env={"BLOCKZOO_STRICT_PLUGINS": "1"})
        # Two generated plugins' tests in one session (as a monorepo or `tests(all)` runs them): no file-name clash.
        session.run("pytest", "--collect-only", "-q", *(str(root / kind / "tests") for kind in kinds))
    finally:
        # The reused environment must not keep plugins of a template that may change before the next run.
        session.run("python", "-m", "pip", "uninstall", "--yes", *(f"blockzoo-template-{kind}" for kind in kinds))
        shutil.rmtree(root)


@nox.session
@discarded_on_ci
def dist(session: nox.Session) -> None:
    """What a release publishes (docs/releasing.md): every distribution's sdist, and its wheel built from that sdist
    (as pip builds from source: a file the sdist lacks is then missing from the wheel too), into dist/; checked by
    `twine check`, `check-wheel-contents` and .ci/check_archives.py; then installed into a fresh environment outside
    the repository, where the core's README is followed (its Install and Quick start blocks, run as written: the
    wheels stand in for the index's blockzoo distributions and this file's TORCH for the README's torch line), and
    every published wheel is installed and checked together (`blockzoo plugins --check`)."""
    session.install("build>=1", "twine>=6", "check-wheel-contents>=0.6", "setuptools>=77")
    output = ROOT / "dist"
    shutil.rmtree(output, ignore_errors=True)
    folders = distributions()
    for folder in folders.values():
        session.run("python", "-m", "build", "--no-isolation", "--outdir", str(output), str(folder), silent=True)
    wheels = sorted(output.glob("*.whl"))
    session.run("twine", "check", "--strict", *map(str, sorted(output.iterdir())))
    session.run("check-wheel-contents", *map(str, wheels))
    session.run("python", ".ci/check_archives.py", str(output), *map(str, folders.values()))
    by_name = {wheel.name.split("-")[0].replace("_", "-"): wheel for wheel in wheels}
    published = [by_name[name] for name, folder in folders.items() if not str(folder).startswith("plugins/examples")]
    home = Path(tempfile.mkdtemp(prefix="blockzoo-wheels-"))
    try:
        session.run("python", "-m", "venv", str(home / "venv"))
        bin_dir = home / "venv" / "bin"
        env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "BLOCKZOO_STRICT_PLUGINS": "1"}
        readme = (ROOT / "core" / "README.md").read_text()
        with session.chdir(home):
            for line in _bash_block(readme, "## Install"):
                arguments = shlex.split(line.split(" #")[0])
                if "torch" in arguments:  # CI reaches PyPI only: the pinned torch the other sessions install
                    arguments = ["pip", "install", TORCH]
                else:  # each blockzoo distribution from its wheel: never the index's
                    arguments = [str(by_name.get(a, a)) for a in arguments]
                # A throwaway environment: no bytecode compiled at install (most of an install's time for torch).
                session.run(str(bin_dir / "python"), "-m", *arguments, "--no-compile", external=True, env=env)
            for line in _bash_block(readme, "## Quick start"):
                session.run("bash", "-euo", "pipefail", "-c", line, external=True, env=env)
            if not (home / "runs" / "demo-llama" / "model.safetensors").is_file():
                session.error("the README's quick start left no exported model in runs/demo-llama")
            session.run(
                str(bin_dir / "python"), "-m", "pip", "install", "--no-compile", *map(str, published), external=True
            )
            session.run(str(bin_dir / "blockzoo"), "plugins", "--check", external=True, env=env)
            session.run(str(bin_dir / "blockzoo"), "--version", external=True, env=env)
    finally:
        shutil.rmtree(home)


def _bash_block(markdown: str, heading: str) -> list[str]:
    """The command lines of the first ```bash block under `heading`."""
    section = markdown.split(f"\n{heading}\n", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


@nox.session
@discarded_on_ci
def docs(session: nox.Session) -> None:
    """The documentation site (mkdocs.yml), built with warnings as errors into site/. The distributions are
    installed without their dependencies: the config reference is generated from their config modules, which import
    no torch, and the API reference from the sources (docs_hooks.py)."""
    session.install("mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26")
    session.install("pluggy>=1.5", "attrs>=23.1", "cattrs>=24.1", "pyyaml>=6", "packaging>=23", "setuptools>=77")
    folders = [str(ROOT / folder) for folder in distributions().values()]
    session.install("--no-deps", "--no-build-isolation", *folders)
    session.run("mkdocs", "build", "--strict", env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
