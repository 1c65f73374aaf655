"""A plugin's layer that raises while it is built or run, or returns a tensor of the wrong
shape, makes `blockzoo train` print one message naming the plugin (its distribution), the layer's path and the
error, with exit code 2 and no traceback; `--traceback` or BLOCKZOO_TRACEBACK=1 shows the traceback.

The plugin is a throwaway one written by the test into a directory of its own (a package and the `dist-info` that
declares its entry point, as pip would install it), put on PYTHONPATH of the subprocess."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

PLUGIN = {
    "blockzoo_test_faulty/__init__.py": "",
    "blockzoo_test_faulty/config.py": """
        from blockzoo.api import MixerConfig, configclass, field


        @configclass
        class FaultyMixerConfig(MixerConfig):
            fault: str = field("none", doc="none, build, forward or shape: where the layer goes wrong.")
        """,
    "blockzoo_test_faulty/plugin.py": """
        from blockzoo.api import hookimpl
        from blockzoo_test_faulty.config import FaultyMixerConfig


        @hookimpl
        def register_mixers(register):
            register("faulty.mixer", FaultyMixerConfig, "blockzoo_test_faulty.mixer:FaultyMixer")
        """,
    "blockzoo_test_faulty/mixer.py": """
        import torch


        def check_dimensions(shape):
            raise ValueError(f"bad dimensions {shape} (simulated)")


        class FaultyMixer(torch.nn.Module):
            def __init__(self, config, **context):
                super().__init__()
                if config.fault == "build":
                    check_dimensions(7)
                self.fault = config.fault

            def forward(self, hidden, batch, state=None):
                if self.fault == "forward":
                    return hidden.view(-1, 3, 5)  # a bug: the view does not fit
                if self.fault == "shape":
                    return hidden[..., :-1]
                if self.fault == "compile":  # as torch.compile reports a broken cache entry
                    from torch._inductor.exc import InductorError

                    raise InductorError(ImportError("/tmp/cache/ab/cab.main.so: file too short"), None)
                return hidden * 0.5

            def flops(self, batch):
                return 0, 0
        """,
    "blockzoo_test_faulty-0.2.0.dist-info/METADATA": """
        Metadata-Version: 2.1
        Name: blockzoo-test-faulty
        Version: 0.2.0
        Requires-Dist: blockzoo>=0.1
        """,
    "blockzoo_test_faulty-0.2.0.dist-info/entry_points.txt": """
        [blockzoo.plugins]
        faulty = blockzoo_test_faulty.plugin
        """,
}
PLUGIN_LABEL = "plugin 'faulty' (blockzoo-test-faulty 0.2.0)"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("faulty_site")
    for name, text in PLUGIN.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text).lstrip())
    return root


def train(site: Path, tmp_path: Path, fault: str, *arguments: str, **environment: str) -> subprocess.CompletedProcess:
    """`blockzoo train` of two blocks, attention then the faulty mixer (`decoder.1.mixer`)."""
    run = {
        "model": {
            "hidden_size": 16,
            "embeddings": {"vocab_size": 257},
            "decoder": {
                "type": "pattern",
                "pattern": ["attn", "faulty"],
                "blocks": {
                    "attn": {"mixer": {"type": "attention", "heads": 2, "head_size": 8}},
                    "faulty": {"mixer": {"type": "faulty.mixer", "fault": fault}},
                },
            },
        },
        "data": {"type": "embedded", "num_documents": 20, "sequence_length": 16, "micro_batch_size": 2},
        "training": {"train_iters": 2, "output_dir": str(tmp_path / "run")},
    }
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(run))
    env = {key: value for key, value in os.environ.items() if not key.startswith("BLOCKZOO_")}
    env.update(PYTHONPATH=os.pathsep.join([str(site), env.get("PYTHONPATH", "")]), **environment)
    command = [sys.executable, "-m", "blockzoo", *arguments, "train", str(config)]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


def test_a_working_plugin_layer_trains(site, tmp_path):
    # The control: the same run with a layer that does not fail trains to the end.
    result = train(site, tmp_path, "none")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "run" / "step_2").is_dir()


FAULTS = {
    "build": ("building", "ValueError: bad dimensions 7 (simulated)", "mixer.py:"),
    "forward": ("running", "RuntimeError: shape '[-1, 3, 5]' is invalid", "mixer.py:"),
    "shape": ("running", "LayerOutputError: returned a tensor of shape (32, 15), expected (32, 16)", "block.py:"),
    "compile": ("running", "InductorError: ImportError: /tmp/cache/ab/cab.main.so: file too short", "mixer.py:"),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_failing_plugin_layer_is_named_in_one_message(site, tmp_path, fault):
    stage, error, place = FAULTS[fault]
    result = train(site, tmp_path, fault)
    message = result.stderr.strip()
    assert result.returncode == 2, message
    assert "Traceback" not in message and len(message.splitlines()) <= 2, message
    named = f"the mixer 'faulty.mixer' of {PLUGIN_LABEL} at decoder.1.mixer failed while {stage}: {error}"
    assert named in message and place in message, message
    if stage == "building":  # refused before allocating, by the model built on the meta device: a config error
        assert message.startswith("blockzoo: error: invalid config:\n  model: cannot be built: the mixer"), message
    else:
        assert message.startswith("blockzoo: error: the mixer") and "--traceback" in message, message
    compile_hint = "this is torch.compile failing, not the layer: if a run was stopped while compiling, its cache ("
    assert (compile_hint in message and "training.compile=none" in message) == (fault == "compile"), message


@pytest.mark.parametrize(("flag", "environment"), [(["--traceback"], {}), ([], {"BLOCKZOO_TRACEBACK": "1"})])
def test_traceback_on_request(site, tmp_path, flag, environment):
    result = train(site, tmp_path, "forward", *flag, **environment)
    assert result.returncode == 2
    assert "Traceback (most recent call last)" in result.stderr and "hidden.view(-1, 3, 5)" in result.stderr
    assert result.stderr.rstrip().splitlines()[-1].startswith("blockzoo: error: the mixer 'faulty.mixer' of ")
