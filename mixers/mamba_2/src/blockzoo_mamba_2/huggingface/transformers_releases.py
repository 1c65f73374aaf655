"""What differs between transformers releases: how a config.json spells the floats JSON lacks, and whether a
release is at least a given one (among them, whether Mamba2 and Bamba normalize per group). Torch-free.
"""

from __future__ import annotations

import importlib.metadata
import math
import re
from collections.abc import Mapping
from typing import Any

# transformers 5 writes the floats JSON lacks as {"__float__": "Infinity"} (4.x as a bare `Infinity`).
_FLOAT_TAG = "__float__"
_TAGGED_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def read_float(value: Any) -> float:
    """A float of a config.json, either form."""
    if isinstance(value, Mapping) and set(value) == {_FLOAT_TAG} and value[_FLOAT_TAG] in _TAGGED_FLOATS:
        return _TAGGED_FLOATS[value[_FLOAT_TAG]]
    return float(value)


def write_float(value: float) -> Any:
    """A float as transformers 5 writes it in a config.json."""
    return {_FLOAT_TAG: "Infinity"} if value == math.inf else value


def transformers_release_at_least(release: tuple[int, int], version: str | None = None) -> bool:
    """Whether transformers `version` (None: the installed one; none installed: the newest) is `release` or later."""
    if version is None:
        try:
            version = importlib.metadata.version("transformers")
        except importlib.metadata.PackageNotFoundError:
            return True
    found = re.match(r"(\d+)\.(\d+)", str(version))
    return found is None or (int(found[1]), int(found[2])) >= release


# transformers' Mamba2 and Bamba normalize per group since this release, over the whole inner dimension before.
_PER_GROUP_SINCE = (5, 23)


def transformers_norm_is_per_group(version: str | None) -> bool:
    """Whether transformers `version` (None: the installed one; none installed: the newest) normalizes per group."""
    return transformers_release_at_least(_PER_GROUP_SINCE, version)
