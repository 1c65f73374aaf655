"""What must answer without importing torch, checked in fresh processes with every first-party plugin installed:
structuring the demo config (its types resolved through the attention and MLP plugins), and `blockzoo plugins`."""

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
STRUCTURE_THE_DEMO = """
import json, sys
from blockzoo.config import load
from blockzoo.run_config import RunConfig

block = load(RunConfig, sys.argv[1]).model.decoder.block
torch = sorted(name for name in sys.modules if name == "torch" or name.startswith("torch."))
print(json.dumps({"mixer": type(block.mixer).__module__, "mlp": type(block.mlp).__module__, "torch": torch}))
"""


def _imported_torch_modules(importtime_log: str) -> list[str]:
    """Modules named in `python -X importtime` output that are torch or part of it."""
    names = [line.rsplit("|", 1)[-1].strip() for line in importtime_log.splitlines() if line.startswith("import time:")]
    return [name for name in names if name == "torch" or name.startswith("torch.")]


def test_structuring_the_demo_config_imports_no_torch():
    command = [sys.executable, "-c", STRUCTURE_THE_DEMO, str(ROOT / "examples" / "demo.yaml")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    # The types came from the plugins' config modules, and nothing pulled torch in.
    assert report == {"mixer": "blockzoo_attention.config", "mlp": "blockzoo_mlp.config", "torch": []}


def test_plugins_json_lists_attention_and_mlp_without_importing_torch():
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "blockzoo", "plugins", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    seconds = time.perf_counter() - start
    print(f"`blockzoo plugins --json` answered in {seconds:.2f} s (with -X importtime)")
    assert result.returncode == 0, result.stderr
    assert _imported_torch_modules(result.stderr) == []
    assert "blockzoo.plugins" in result.stderr  # the import log is there: the check above can see torch
    plugins = {plugin["name"]: plugin for plugin in json.loads(result.stdout)["plugins"]}
    assert plugins["attention"]["status"] == "loaded" and plugins["mlp"]["status"] == "loaded"
    assert plugins["attention"]["distribution"] == "blockzoo-attention"
    assert plugins["attention"]["types"]["mixer"] == ["attention"]
    assert set(plugins["attention"]["types"]["rotary"]) == {"none", "default", "llama3", "yarn", "partial"}
    assert plugins["mlp"]["distribution"] == "blockzoo-mlp"
    assert plugins["mlp"]["types"] == {"mlp": ["mlp"]}
