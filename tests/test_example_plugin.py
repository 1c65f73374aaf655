"""The example third-party plugin (plugins/examples/shortconv) as a user gets it: `pip install`ed (into a private
directory put on PYTHONPATH of subprocesses, as core/tests/test_installed_plugins.py does), listed by
`blockzoo plugins`, then used in a hybrid model beside attention and Mamba 2 that `blockzoo train` trains (the
loss falls) and `blockzoo generate` continues a prompt with (every mixer's generation state in play)."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from blockzoo.plugins import PLUGIN_API

PLUGINS = Path(__file__).parents[1] / "plugins"
EXAMPLE = PLUGINS / "examples" / "shortconv"
TRAIN_ITERS = 16
RUN = {
    "model": {
        "hidden_size": 32,
        "tied_embedding_weight": True,
        "embeddings": {"vocab_size": 257},
        "decoder": {
            "type": "pattern",
            "num_blocks": 3,
            "pattern": ["conv", "ssm", "attn"],
            "blocks": {
                "conv": {
                    "mixer": {"type": "shortconv.gated_conv", "channels": 64, "kernel_size": 4},
                    "mlp": {"type": "mlp", "intermediate_size": 64, "gated": True},
                },
                "ssm": {
                    "mixer": {"type": "mamba_2", "heads": 2, "head_size": 16, "state_size": 8, "chunk_size": 16},
                    "mlp": {"type": "none"},
                },
                "attn": {
                    "mixer": {"type": "attention", "heads": 2, "head_size": 16},
                    "mlp": {"type": "mlp", "intermediate_size": 64, "gated": True},
                },
            },
        },
    },
    "distributed": {"backend": "gloo", "seed": 7},
    "data": {"type": "embedded", "num_documents": 64, "sequence_length": 64, "micro_batch_size": 4},
    "training": {
        "train_iters": TRAIN_ITERS,
        "optimizer": {"learning_rate": 1.0e-2},
        "schedule": {"warmup_iters": 2},
        "log_interval": 1,
        "evaluation": {"interval": None},
    },
}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    # Built from a copy, so that the build leaves nothing in the repository.
    source = tmp_path_factory.mktemp("source") / "shortconv"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = tmp_path_factory.mktemp("site")
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip, "--target", str(target), str(source)], check=True, capture_output=True)
    return target


def blockzoo(site: Path, *arguments: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if not key.startswith("BLOCKZOO_")}
    env.update(PYTHONPATH=os.pathsep.join([str(site), env.get("PYTHONPATH", "")]), BLOCKZOO_STRICT_PLUGINS="1")
    return subprocess.run(
        [sys.executable, "-m", "blockzoo", *arguments], capture_output=True, text=True, env=env, timeout=600
    )


def test_the_installed_example_is_discovered(site):
    result = blockzoo(site, "plugins", "--json")
    assert result.returncode == 0, result.stderr
    plugins = {plugin["name"]: plugin for plugin in json.loads(result.stdout)["plugins"]}
    shortconv = plugins["shortconv"]
    assert shortconv["status"] == "loaded" and shortconv["distribution"] == "blockzoo-shortconv"
    assert shortconv["location"] == str(site / "blockzoo_shortconv")
    assert shortconv["types"] == {"mixer": ["shortconv.gated_conv"]}
    assert shortconv["capabilities"] == [
        "generation_cache",
        "sequence_data_parallel",
        "sequence_tensor_parallel",
        "tensor_parallel",
    ]


def test_the_template_and_the_example_declare_this_plugin_api():
    # plugin_info's api_version is written out, so the handshake means something; a new PLUGIN_API updates both.
    declared = f"api_version=({PLUGIN_API[0]}, {PLUGIN_API[1]}),"
    for hooks in [
        PLUGINS / "template/project/src/{{ package_name }}/plugin.py.jinja",
        EXAMPLE / "src/blockzoo_shortconv/plugin.py",
    ]:
        assert declared in hooks.read_text(), hooks


def test_a_hybrid_model_with_the_example_trains_and_generates(site, tmp_path):
    config = tmp_path / "hybrid.yaml"
    output_dir = tmp_path / "run"
    config.write_text(yaml.safe_dump({**RUN, "training": {**RUN["training"], "output_dir": str(output_dir)}}))
    result = blockzoo(site, "train", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    losses = [float(loss) for loss in re.findall(r"step \d+/\d+ \| loss ([0-9.]+)", result.stdout)]
    assert len(losses) == TRAIN_ITERS, result.stdout
    print(f"losses: {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 1.0, losses
    saved = yaml.safe_load((output_dir / f"step_{TRAIN_ITERS}" / "metadata.yaml").read_text())
    assert saved["plugins"]["shortconv"]["distribution"] == "blockzoo-shortconv"

    result = blockzoo(site, "generate", str(output_dir), "--prompt", "Once upon", "--max-new-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Once upon") and len(result.stdout) > len("Once upon")
