"""Every distribution of the repository is ready to publish: the licence, the metadata PyPI shows, a README that
stands alone there, `py.typed`, one version, requirements that name only what is published, and an sdist that
leaves its tests out on purpose. The folders are those noxfile.py's DISTRIBUTION_FOLDERS finds, so a new
distribution cannot be added without all of it. (`nox -s dist` builds and checks the archives themselves.)"""

import ast
import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
# The project's home: the one place to change it (docs/releasing.md); every pyproject.toml and README uses it.
HOME = "https://github.com/blockzoo/blockzoo"
DOCS = f"{HOME}/tree/main/docs"
# Examples to copy, never uploaded (their pyproject.toml says `Private :: Do Not Upload`).
UNPUBLISHED = ("plugins/examples/",)


def _distribution_folders() -> list[Path]:
    noxfile = ast.parse((ROOT / "noxfile.py").read_text())
    patterns = next(
        ast.literal_eval(node.value)
        for node in noxfile.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "DISTRIBUTION_FOLDERS"
    )
    return [pyproject.parent for pattern in patterns for pyproject in sorted(ROOT.glob(f"{pattern}/pyproject.toml"))]


FOLDERS = _distribution_folders()
PROJECTS = {folder: tomllib.loads((folder / "pyproject.toml").read_text())["project"] for folder in FOLDERS}
NAMES = {canonicalize_name(project["name"]) for project in PROJECTS.values()}
CORE = PROJECTS[ROOT / "core"]


def _id(folder: Path) -> str:
    return folder.relative_to(ROOT).as_posix()


def _published(folder: Path) -> bool:
    return not _id(folder).startswith(UNPUBLISHED)


def _package(folder: Path) -> Path:
    (package,) = [path for path in (folder / "src").iterdir() if (path / "__init__.py").is_file()]
    return package


def _requirements(project: dict) -> list[Requirement]:
    lines = [*project.get("dependencies", [])]
    for extra in project.get("optional-dependencies", {}).values():
        lines += extra
    return [Requirement(line) for line in lines]


def test_the_layout_finds_every_distribution():
    SKIPPED = ("tests", "template", "build")  # fixture plugins, the plugin template, build trees
    found = {_id(folder) for folder in FOLDERS}
    assert {"core", "mixers/attention", "mlps/mlp", "converters/huggingface", "trackers/wandb"} <= found
    assert {"libraries/ssm", "libraries/testing", "libraries/corpora"} <= found
    assert "adapters/lora" in found
    # A folder with a pyproject.toml that the patterns miss would escape every check here and in nox.
    everywhere = {
        _id(path.parent)
        for path in ROOT.glob("*/**/pyproject.toml")
        if not any(part.startswith(".") or part in SKIPPED for part in path.relative_to(ROOT).parts)
    }
    assert everywhere == found


@pytest.mark.parametrize("folder", FOLDERS, ids=_id)
def test_licence(folder):
    project = PROJECTS[folder]
    assert (folder / "LICENSE").read_bytes() == (ROOT / "LICENSE").read_bytes(), f"{_id(folder)}/LICENSE"
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()
    assert project.get("license") == "Apache-2.0" and project.get("license-files") == ["LICENSE"]
    # With a licence expression (PEP 639) a licence classifier is an error for the index.
    assert not [c for c in project.get("classifiers", []) if c.startswith("License ::")]
    build_requires = tomllib.loads((folder / "pyproject.toml").read_text())["build-system"]["requires"]
    assert "setuptools>=77" in build_requires, "setuptools reads PEP 639 licence fields from version 77"


@pytest.mark.parametrize("folder", FOLDERS, ids=_id)
def test_metadata_pypi_shows(folder):
    project = PROJECTS[folder]
    assert project.get("authors") and project.get("description") and project.get("readme") == "README.md"
    classifiers = project.get("classifiers", [])
    for expected in ["Programming Language :: Python :: 3", "Typing :: Typed", "Development Status :: 3 - Alpha"]:
        assert expected in classifiers, f"{_id(folder)}: classifier {expected!r}"
    # The conformance kit's pytest11 entry point, and only there: pytest loads it in every run where it is installed.
    pytest_plugin = "pytest11" in project.get("entry-points", {})
    assert ("Framework :: Pytest" in classifiers) == pytest_plugin, f"{_id(folder)}: Framework :: Pytest"
    assert pytest_plugin == (folder == ROOT / "libraries" / "testing")
    assert ("Private :: Do Not Upload" in classifiers) == (not _published(folder))
    urls = project.get("urls", {})
    assert urls.get("Homepage") == HOME and urls.get("Documentation") == DOCS
    assert urls.get("Changelog") == f"{HOME}/blob/main/CHANGELOG.md" and urls.get("Source") == HOME


@pytest.mark.parametrize("folder", FOLDERS, ids=_id)
def test_readme_stands_alone(folder):
    text = (folder / "README.md").read_text()
    links = re.findall(r"\]\(([^)]+)\)", text)
    relative = [link for link in links if not link.startswith(("https://", "http://", "#"))]
    assert not relative, f"{_id(folder)}/README.md: relative links break on PyPI: {relative}"
    assert DOCS in text and "Apache-2.0" in text
    if _published(folder):
        assert f"pip install {PROJECTS[folder]['name']}" in text, "how to install it from the index"


@pytest.mark.parametrize("folder", FOLDERS, ids=_id)
def test_typed_and_packaged(folder):
    package = _package(folder)
    assert (package / "py.typed").is_file()
    package_data = tomllib.loads((folder / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data[package.name]
    manifest = (folder / "MANIFEST.in").read_text().splitlines()
    # The decision (docs/releasing.md): tests stay out of the sdist; nox -s dist checks the archives.
    assert "prune tests" in manifest


@pytest.mark.parametrize("folder", FOLDERS, ids=_id)
def test_one_version(folder):
    project = PROJECTS[folder]
    assert project["version"] == CORE["version"], f"{_id(folder)} is {project['version']}, the core {CORE['version']}"
    assert "version" not in project.get("dynamic", [])
    # What is installed here was built from this pyproject.toml (an editable install records its version).
    assert importlib.metadata.version(project["name"]) == project["version"]
    core = Version(CORE["version"])
    for requirement in _requirements(project):
        if canonicalize_name(requirement.name) == "blockzoo":
            assert requirement.specifier.contains(core), f"{_id(folder)}: {requirement} excludes blockzoo {core}"


def test_dunder_versions_read_the_metadata():
    import blockzoo

    assert blockzoo.__version__ == importlib.metadata.version("blockzoo") == CORE["version"]
    for folder, project in PROJECTS.items():
        module = __import__(_package(folder).name)
        if hasattr(module, "__version__"):
            assert module.__version__ == importlib.metadata.version(project["name"]), _id(folder)
        source = (_package(folder) / "__init__.py").read_text()
        assert not re.search(r"__version__\s*=\s*[\"']", source), f"{_id(folder)}: a second copy of the version"


@pytest.mark.parametrize("folder", FOLDERS, ids=_id)
def test_requirements_name_only_published_distributions(folder):
    """pip looks every name up on the index: a `blockzoo-*` name must be one this repository publishes (uploaded
    before it: docs/releasing.md's order), never an unpublished one someone else could take."""
    for requirement in _requirements(PROJECTS[folder]):
        name = canonicalize_name(requirement.name)
        if name.startswith("blockzoo"):
            assert name in NAMES, f"{_id(folder)} requires {name}, which is no distribution of this repository"
            (target,) = [f for f, p in PROJECTS.items() if canonicalize_name(p["name"]) == name]
            assert _published(target), f"{_id(folder)} requires {name}, which is never uploaded"


@pytest.mark.parametrize("folder", FOLDERS, ids=_id)
def test_torch_declared_where_imported(folder):
    imports_torch = any(
        re.search(r"(?m)^\s*(import torch|from torch)\b", path.read_text()) for path in _package(folder).rglob("*.py")
    )
    declared = any(canonicalize_name(r.name) == "torch" for r in map(Requirement, PROJECTS[folder]["dependencies"]))
    assert declared == imports_torch, f"{_id(folder)}: imports torch: {imports_torch}, declares it: {declared}"


def test_release_order_uploads_requirements_first():
    """docs/releasing.md names every published distribution once, each after the distributions it requires."""
    text = (ROOT / "docs" / "releasing.md").read_text()
    section = text.split("## Upload order", 1)[1].split("\n## ", 1)[0]
    order = [canonicalize_name(name) for name in re.findall(r"^\d+\. `([a-z0-9-]+)`", section, re.M)]
    published = {canonicalize_name(p["name"]) for f, p in PROJECTS.items() if _published(f)}
    assert sorted(order) == sorted(published), "the upload order lists each published distribution once"
    for folder, project in PROJECTS.items():
        if not _published(folder):
            continue
        position = order.index(canonicalize_name(project["name"]))
        for requirement in _requirements(project):
            if canonicalize_name(requirement.name) in published:
                assert order.index(canonicalize_name(requirement.name)) < position, (project["name"], requirement)


def test_the_plugin_template_carries_the_licence():
    template = ROOT / "plugins" / "template" / "project"
    assert (template / "LICENSE").read_bytes() == (ROOT / "LICENSE").read_bytes()
    pyproject = (template / "pyproject.toml.jinja").read_text()
    assert 'license = "Apache-2.0"' in pyproject and 'license-files = ["LICENSE"]' in pyproject
    assert (template / "src" / "{{ package_name }}" / "py.typed").is_file()
