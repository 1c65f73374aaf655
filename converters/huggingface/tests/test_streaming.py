"""Conversion streams: a synthetic multi-shard checkpoint converts, in both directions, with a peak memory of about
one shard, not the model. Measured in a fresh process with `resource.getrusage` (peak RSS)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from blockzoo.safetensors_io import SafetensorsWriter

MB = 2**20
HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 512, 1536, 12, 8192
CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": VOCAB,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}

# Runs the conversion a second time in one process, after the peak RSS is reset (Linux clear_refs, so the first
# one's imports and set-up do not hide the second's); prints the RSS then and the peak RSS after (bytes).
MEASURE = """
import json, resource, shutil, sys
from blockzoo.model.factory import convert
# A first conversion imports the plugins' layers and builds the model on the meta device (tens of MB, as the installed
# packages make it): the measured second one holds what the conversion itself holds.
warm_up = sys.argv[2] + ".warm-up"
convert(sys.argv[1], warm_up, **json.loads(sys.argv[3]))
shutil.rmtree(warm_up)
with open("/proc/self/clear_refs", "w") as file:
    file.write("5")
before = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS"))
convert(sys.argv[1], sys.argv[2], **json.loads(sys.argv[3]))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"before": before * 1024, "after": peak * 1024}))
"""


def _layer_tensors(index: int) -> dict[str, tuple[int, ...]]:
    prefix = f"model.layers.{index}"
    return {
        f"{prefix}.input_layernorm.weight": (HIDDEN,),
        **{f"{prefix}.self_attn.{p}_proj.weight": (HIDDEN, HIDDEN) for p in "qkvo"},
        f"{prefix}.post_attention_layernorm.weight": (HIDDEN,),
        f"{prefix}.mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
        f"{prefix}.mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
        f"{prefix}.mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
    }


def _write_checkpoint(directory) -> tuple[int, int]:
    """A Llama checkpoint of random weights, one shard per layer (and one for each end), written tensor by tensor.
    Returns (total bytes, largest shard bytes)."""
    shards = [{"model.embed_tokens.weight": (VOCAB, HIDDEN)}]
    shards += [_layer_tensors(index) for index in range(LAYERS)]
    shards += [{"model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)}]
    generator = torch.Generator().manual_seed(0)
    weight_map, sizes = {}, []
    for number, shard in enumerate(shards, 1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        layout = {tensor: (torch.float32, shape) for tensor, shape in shard.items()}
        with SafetensorsWriter(directory / name, layout, {"format": "pt"}) as writer:
            for tensor, shape in shard.items():
                writer.write(tensor, torch.randn(shape, generator=generator) * 0.02)
                weight_map[tensor] = name
        sizes.append(sum(math.prod(shape) * 4 for shape in shard.values()))
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text(json.dumps(CONFIG))
    return sum(sizes), max(sizes)


# The measuring process is started by a bare interpreter, not by pytest: a process's `ru_maxrss` starts at the peak
# RSS of the process it was forked from (the kernel copies it with the memory map and keeps it across exec), and
# pytest's own would hide the conversion's.
LAUNCH = "import subprocess, sys; sys.exit(subprocess.run([sys.executable, *sys.argv[1:]]).returncode)"


def _peak_growth(source, destination, **options) -> int:
    """Bytes the conversion added to the peak RSS of a fresh process."""
    result = subprocess.run(
        [sys.executable, "-S", "-c", LAUNCH, "-c", MEASURE, str(source), str(destination), json.dumps(options)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    return measured["after"] - measured["before"]


def _same_tensors(first, second) -> None:
    """Tensor by tensor, one at a time (the test itself must not hold the model either)."""
    names = json.loads((first / "model.safetensors.index.json").read_text())["weight_map"]
    other = json.loads((second / "model.safetensors.index.json").read_text())["weight_map"]
    assert names.keys() == other.keys()
    for name, file in names.items():
        with safe_open(first / file, "pt") as a, safe_open(second / other[name], "pt") as b:
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name


@pytest.mark.slow
def test_a_multi_shard_checkpoint_converts_in_about_one_shard_of_memory(tmp_path):
    (tmp_path / "hf").mkdir()
    total, shard = _write_checkpoint(tmp_path / "hf")
    assert total > 180 * MB and shard < 17 * MB

    growth = _peak_growth(tmp_path / "hf", tmp_path / "native")
    print(f"HF -> blockzoo: {total / MB:.0f} MB in shards of {shard / MB:.1f} MB, peak RSS +{growth / MB:.1f} MB")
    assert growth < 3 * shard + 16 * MB

    growth = _peak_growth(tmp_path / "native", tmp_path / "back", format="llama", max_shard_size=17 * MB)
    print(f"blockzoo -> HF: {total / MB:.0f} MB in one file, peak RSS +{growth / MB:.1f} MB")
    assert growth < 3 * shard + 16 * MB
    assert len(list((tmp_path / "back").glob("model-*.safetensors"))) > 10
    _same_tensors(tmp_path / "hf", tmp_path / "back")
