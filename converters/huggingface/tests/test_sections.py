"""The sections themselves: every field of every config class a format converts is claimed, and the config side
of the conversion (the plugin, its sections, reading a config.json) runs without torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from blockzoo.config import structure
from blockzoo.conversion import checkpoint_formats, sections, unclaimed_fields
from blockzoo.model.config import ModelConfig

FORMATS = ["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"]


def test_the_formats_are_registered():
    assert set(FORMATS) <= set(checkpoint_formats())


@pytest.mark.parametrize("format_name", FORMATS)
def test_every_field_of_every_converted_config_class_is_claimed(format_name):
    registered = sections(format_name)
    assert {cls.__name__ for cls in registered} >= {
        "AttentionConfig",
        "DecoderBlockConfig",
        "RMSNormalizationConfig",
        "MoEMLPConfig" if format_name in ("mixtral", "qwen2_moe", "qwen3_moe") else "DenseMLPConfig",
    }
    for config_class, section in registered.items():
        assert unclaimed_fields(section, structure({}, config_class)) == [], config_class.__name__
    model_section = checkpoint_formats()[format_name].model_section
    assert unclaimed_fields(model_section, ModelConfig(), claimed=("decoder",)) == []


def test_a_field_no_section_claims_is_an_error():
    from blockzoo.conversion import ConversionError, Rename, Section, export_config
    from blockzoo_attention.config import AttentionConfig

    partial = Section(config_class=AttentionConfig, config=(Rename("heads", "num_attention_heads"),))
    with pytest.raises(ConversionError, match=r"does not handle `x.head_groups`, `x.head_size`, .*`x.rotary`"):
        export_config("llama", structure({}, AttentionConfig), section=partial, path="x")


READ_A_CONFIG_WITHOUT_TORCH = """
import json, sys
from blockzoo.conversion import detect_format
from pathlib import Path
found = detect_format(Path(sys.argv[1]))
data = found.read_model_config(Path(sys.argv[1]))
torch = sorted(name for name in sys.modules if name == "torch" or name.startswith("torch."))
print(json.dumps({"format": found.name, "heads": data["decoder"]["block"]["mixer"]["heads"], "torch": torch}))
"""


def test_reading_a_config_json_imports_no_torch(tmp_path):
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 128,
        "rope_theta": 10000.0,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = subprocess.run(
        [sys.executable, "-c", READ_A_CONFIG_WITHOUT_TORCH, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"format": "llama", "heads": 4, "torch": []}
