"""Checks of a plugin's config tests: an error that names the field by its full path, config and hook modules
that import no torch (blockzoo reads configs and lists plugins without it), and the type registered with its
capabilities.

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
from blockzoo.plugins import get_registry


def check_config_error(config_class: type[Config], data: Mapping[str, Any], message: str, *, root: str = "mixer"):
    """Structuring `data` as `config_class` at `root` fails with a ConfigError whose report has the line
    `  {root}.{message}` (`message`: a regular expression, the field's path within the config and its problem)."""
    with pytest.raises(ConfigError, match=rf"\n  {re.escape(root)}\.{message}"):
        structure(data, config_class, root=root)


def check_imports_no_torch(*modules: str) -> None:
    """Importing `modules` in a fresh interpreter imports no torch."""
    code = f"import sys, {', '.join(modules)}; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def check_registered(
    kind: str, name: str, config_class: type[Config], implementation: str, capabilities: set[str]
) -> Any:
    """The type `name` of `kind` ("mixer", "mlp"...) resolves to `config_class` and to an implementation class named
    `implementation`; the config class declares exactly `capabilities`, and the plugin that registered the type is
    loaded and lists them. Returns the plugin's record (`.distribution`, `.types`, `.info`)."""
    registry = get_registry()
    entry = registry.resolve(kind, name)
    assert entry.config_class is config_class
    assert entry.load_implementation().__name__ == implementation
    assert config_class.capabilities == capabilities
    plugin = registry.plugins[entry.plugin.name]
    assert plugin.status == "loaded" and set(plugin.info.capabilities) == config_class.capabilities
    return plugin
