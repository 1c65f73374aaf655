"""The qwen3_next format (Qwen3NextForCausalLM: Gated DeltaNet and gated attention layers, (1 + w) norms, MoE with a
gated shared expert) against transformers itself: import, export, both round trips, and the layer layout.

The case is a tiny random transformers model whose mapped fields are away from their defaults
(hf_cases_qwen3_next.py); transformers runs its torch path of the gated delta rule (no flash-linear-attention here).
The Hugging Face → blockzoo → Hugging Face round trip is exact except for the (1 + w) norm weights: blockzoo holds
1 + w in fp32 (what transformers multiplies by), so w comes back rounded to the precision of 1 + w.
"""

from __future__ import annotations

import pytest
import torch
from format_checks import (
    check_blockzoo_round_trip,
    check_export,
    check_import,
    comparable,
    read_config,
    read_tensors,
    saved_transformers_cases,
)
from hf_cases_qwen3_next import CASES, format_of

import blockzoo
from blockzoo.conversion import ConversionError
from blockzoo.model.factory import convert
from blockzoo_huggingface.formats_qwen3_next import Qwen3NextLayers

OFFSET_NORMS = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight")


@pytest.fixture(scope="module")
def hf_directories(tmp_path_factory):
    return saved_transformers_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize("case", CASES)
def test_import_gives_the_logits_of_transformers(case, hf_directories):
    directory, _ = hf_directories[case]
    model = blockzoo.load(directory)
    mixers = [type(block.mixer).__name__ for block in model.decoder]
    assert mixers == ["GatedDeltaNet", "Attention", "GatedDeltaNet", "GatedDeltaNet"]
    assert [type(block.mlp).__name__ for block in model.decoder] == ["MoEMLP", "MoEMLP", "DenseMLP", "MoEMLP"]
    check_import(*hf_directories[case])


@pytest.mark.parametrize("case", CASES)
def test_export_loads_in_transformers_with_our_logits(case, hf_directories, tmp_path):
    check_export(hf_directories[case][0], format_of(case), tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_huggingface_to_blockzoo_to_huggingface(case, hf_directories, tmp_path):
    """The same config.json, the same tensors (the (1 + w) norm weights to the rounding of 1 + w in fp32)."""
    directory, _ = hf_directories[case]
    convert(directory, tmp_path / "native")
    convert(tmp_path / "native", tmp_path / "streamed", format=format_of(case))
    blockzoo.save(blockzoo.load(directory), tmp_path / "saved", format=format_of(case))
    original = read_tensors(directory)
    for written in ("streamed", "saved"):
        tensors = read_tensors(tmp_path / written)
        assert tensors.keys() == original.keys()
        for name, tensor in original.items():
            if name.endswith(OFFSET_NORMS):
                ulp = torch.finfo(torch.float32).eps * (1 + tensor).abs()
                assert bool(((tensors[name] - tensor).abs() <= ulp).all()), name
            else:
                assert torch.equal(tensors[name], tensor), name
        assert comparable(read_config(tmp_path / written)) == comparable(read_config(directory))
        assert blockzoo.load(tmp_path / written).config == blockzoo.load(directory).config


@pytest.mark.parametrize("case", CASES)
def test_blockzoo_to_huggingface_to_blockzoo_is_identical(case, hf_directories, tmp_path):
    check_blockzoo_round_trip(hf_directories[case][0], format_of(case), tmp_path)


def test_layer_types_or_the_full_attention_interval():
    layout = Qwen3NextLayers()
    base = {"num_hidden_layers": 4}
    mixers = [layer.types["mixer"] for layer in layout.layers({**base, "full_attention_interval": 2})]
    assert mixers == ["gated_delta_net", "attention", "gated_delta_net", "attention"]
    mixers = [layer.types["mixer"] for layer in layout.layers(base)]  # transformers' default interval, 4
    assert mixers == ["gated_delta_net"] * 3 + ["attention"]
    with pytest.raises(ConversionError, match="`layer_types` must list 4 of linear_attention / full_attention"):
        layout.layers({**base, "layer_types": ["linear_attention"] * 3 + ["sliding_attention"]})
