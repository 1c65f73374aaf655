"""Check the archives `nox -s dist` built (python .ci/check_archives.py DIST_DIR FOLDER...): each sdist holds
its LICENSE, README and pyproject.toml and, on purpose, no tests (docs/releasing.md); each wheel holds exactly the
package files of its distribution's src/ (modules, py.typed, the core's examples), its licence, and metadata that
says Apache-2.0 and the version of its pyproject.toml. Exit 1 with every problem listed."""

import sys
import tarfile
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_FILES = (".py", ".yaml", "py.typed")


def main(dist: Path, folders: list[Path]) -> int:
    problems = []
    for folder in folders:
        project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        stem = f"{project['name'].replace('-', '_')}-{project['version']}"
        problems += [f"{folder.name}: {p}" for p in _sdist(dist / f"{stem}.tar.gz", stem)]
        wheel = dist / f"{stem}-py3-none-any.whl"
        problems += [f"{folder.name}: {p}" for p in _wheel(wheel, folder, project)]
    for problem in problems:
        print(f"check_archives: {problem}", file=sys.stderr)
    print(f"check_archives: {len(folders)} sdists and wheels checked, {len(problems)} problems", file=sys.stderr)
    return 1 if problems else 0


def _sdist(path: Path, stem: str) -> list[str]:
    if not path.is_file():
        return [f"no sdist {path.name}"]
    with tarfile.open(path) as archive:
        names = {name.removeprefix(f"{stem}/") for name in archive.getnames()}
        metadata = Parser().parsestr(archive.extractfile(f"{stem}/PKG-INFO").read().decode())
    problems = [f"{path.name} lacks {name}" for name in ("LICENSE", "README.md", "pyproject.toml") if name not in names]
    problems += [f"{path.name} holds tests: {name}" for name in sorted(names) if name.startswith("tests/")]
    if metadata["License-Expression"] != "Apache-2.0":
        problems.append(f"{path.name}: License-Expression {metadata['License-Expression']!r}")
    return problems


def _wheel(path: Path, folder: Path, project: dict) -> list[str]:
    if not path.is_file():
        return [f"no wheel {path.name}"]
    with zipfile.ZipFile(path) as archive:
        names = set(archive.namelist())
        (metadata_name,) = [name for name in names if name.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(archive.read(metadata_name).decode())
    packaged = {name for name in names if ".dist-info/" not in name}
    expected = {
        file.relative_to(folder / "src").as_posix()
        for file in (folder / "src").rglob("*")
        if file.is_file()
        and file.name.endswith(PACKAGE_FILES)
        and ".egg-info" not in file.as_posix()
        and "__pycache__" not in file.parts
    }
    problems = [f"{path.name} lacks {name}" for name in sorted(expected - packaged)]
    problems += [f"{path.name} holds {name}, not in src/" for name in sorted(packaged - expected)]
    if not any(name.endswith(".dist-info/licenses/LICENSE") for name in names):
        problems.append(f"{path.name} lacks its licence")
    if metadata["License-Expression"] != "Apache-2.0" or metadata["Version"] != project["version"]:
        problems.append(f"{path.name}: License-Expression {metadata['License-Expression']!r}, {metadata['Version']}")
    return problems


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), [ROOT / folder for folder in sys.argv[2:]]))
