"""MkDocs hooks (mkdocs.yml): the pages generated at build time, and links out of docs/ made absolute.

- config-reference.md: `blockzoo config schema` of the distributions installed where the site is built, so the
  site never shows a stale reference (the committed file is what GitHub shows).
- api-reference.md: one mkdocstrings block per public name of `blockzoo` and `blockzoo.api`, each from the module
  that defines it; the names are read from the sources (no torch is imported to build the site).
- A link from a page to a file outside docs/ (`../examples/demo.yaml`) points at the repository on GitHub.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parent
SOURCE = ROOT / "core" / "src" / "blockzoo"
HOME = "https://github.com/blockzoo/blockzoo"


def on_files(files, config):
    from mkdocs.structure.files import File  # here: the tests import this module where mkdocs is not installed

    files.append(File.generated(config, "api-reference.md", content=api_reference()))
    return files


def on_page_read_source(page, config) -> str | None:
    if page.file.src_uri == "config-reference.md":
        from blockzoo.schema import config_reference

        return config_reference()
    return None


def on_page_markdown(markdown: str, page, config, files) -> str:
    depth = page.file.src_uri.count("/")

    def absolute(match: re.Match) -> str:
        target = match.group(1)
        parts = Path(page.file.src_uri).parent.joinpath(target).as_posix().split("/")
        if target.startswith(("http", "#", "mailto:")) or parts.count("..") <= depth:
            return match.group(0)
        return f"]({HOME}/blob/main/{target.replace('../' * (depth + 1), '', 1)})"

    return re.sub(r"\]\(([^)\s]+)\)", absolute, markdown)


def api_reference() -> str:
    sections = [
        "# API reference",
        "",
        "Generated from the docstrings at build time. [Python API](python-api.md) shows these names at work; "
        "[the plugin API](plugins/api.md) says what is public and stable for plugins.",
    ]
    for module, title, note in [
        ("blockzoo", "`blockzoo`", "Models, runs and their configs."),
        ("blockzoo.api", "`blockzoo.api`", "Everything a plugin may import from blockzoo."),
    ]:
        sections += ["", f"## {title}", "", note]
        former = former_names(module)
        for name, origin in public_names(module).items():
            if name in former:
                continue
            sections += ["", f"::: {origin}.{name}", "    options:", f"      heading: {module}.{name}"]
    return "\n".join(sections) + "\n"


def public_names(module: str) -> dict[str, str]:
    """Each name of the module's `__all__` -> the module that defines it, from the imports and the lazy tables
    (`_API`, `_LAZY`: name -> module) of its source; a deprecated former name (`_FORMER_NAMES`: former -> current)
    -> its current name's module."""
    origins, tables, exported = _read(module)
    origins.update(tables.get("_API", {}), **tables.get("_LAZY", {}))
    origins.update({former: origins[current] for former, current in tables.get("_FORMER_NAMES", {}).items()})
    return {name: origins[name] for name in exported if name in origins and not name.startswith("_")}


def former_names(module: str) -> set[str]:
    """The module's deprecated former names (`_FORMER_NAMES`): importable, not given a reference entry of their own."""
    return set(_read(module)[1].get("_FORMER_NAMES", {}))


def _read(module: str) -> tuple[dict[str, str], dict[str, dict[str, str]], list[str]]:
    """What the module's source says at its top level: (imported name -> module, its tables by name, `__all__`)."""
    path = SOURCE / ("__init__.py" if module == "blockzoo" else module.removeprefix("blockzoo.") + ".py")
    origins: dict[str, str] = {}
    tables: dict[str, dict[str, str]] = {}
    exported: list[str] = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("blockzoo"):
            origins.update({alias.asname or alias.name: node.module for alias in node.names})
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            target = node.targets[0].id
            if target in ("_API", "_LAZY", "_FORMER_NAMES"):
                tables[target] = ast.literal_eval(node.value)
            if target == "__all__":
                for element in node.value.elts:
                    if isinstance(element, ast.Constant):
                        exported.append(element.value)
                    elif isinstance(element, ast.Starred) and isinstance(element.value, ast.Name):
                        exported += tables.get(element.value.id, {})
    return origins, tables, exported
