"""The documentation site's sources (`nox -s docs` builds it strictly): the API reference covers every public name,
and no page cites an internal work item a reader cannot look up."""

import importlib
import importlib.util
import re
from pathlib import Path

import blockzoo
import blockzoo.api

ROOT = Path(__file__).resolve().parents[1]


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_api_reference_documents_every_public_name_where_it_is_defined():
    hooks = _hooks()
    for module in (blockzoo, blockzoo.api):
        origins = hooks.public_names(module.__name__)
        assert set(origins) == {name for name in module.__all__ if not name.startswith("_")}, module.__name__
        for name, origin in origins.items():
            value = getattr(module, name)
            defined_in = getattr(value, "__module__", None)
            # Constants carry no __module__: their origin module must hold the same object.
            assert defined_in == origin or getattr(importlib.import_module(origin), name) is value, (name, origin)
    page = hooks.api_reference()
    assert "::: blockzoo.python_api.build" in page and "::: blockzoo.config.configclass" in page


def test_no_page_cites_an_internal_work_item():
    pages = [*ROOT.glob("docs/**/*.md"), ROOT / "benchmarks" / "RESULTS.md", ROOT / "README.md", ROOT / "CHANGELOG.md"]
    pages += [*ROOT.glob("*/*/README.md"), ROOT / "core" / "README.md"]
    for page in pages:
        for line in page.read_text().splitlines():
            # Another project's issue, named as such ("flash-linear-attention's issue #640"), can be looked up.
            cited = re.findall(r"(\S*)\s+issues?\s+#?\d+", line, re.IGNORECASE)
            assert all(word.endswith("'s") for word in cited), f"{page.relative_to(ROOT)}: {line.strip()}"
