"""Checks of a plugin's config tests: an error that names the field by its full path, and config and hook modules
that import no torch (blockzoo reads configs and lists plugins without it).

```python
check_config_error(MyMixerConfig, {"heads": 0}, r"heads: must be >= 1, got 0")
check_imports_no_torch("my_plugin.config", "my_plugin.plugin")
```
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import pytest

from blockzoo.config import Config, ConfigError, structure


def check_config_error(config_class: type[Config], data: Mapping[str, Any], message: str, *, root: str = "mixer"):
    """Structuring `data` as `config_class` at `root` fails with a ConfigError whose report has the line
    `  {root}.{message}` (`message`: a regular expression, the field's path within the config and its problem)."""
    with pytest.raises(ConfigError, match=rf"\n  {re.escape(root)}\.{message}"):
        structure(data, config_class, root=root)


def check_imports_no_torch(*modules: str) -> None:
    """Importing `modules` in a fresh interpreter imports no torch."""
    code = f"import sys, {', '.join(modules)}; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
