"""A Hugging Face checkpoint loads into a tensor-parallel model (each rank its shards) with transformers' logits,
and saving it gathers the shards into the very tensors it came from. Two gloo ranks, one spawn."""

from __future__ import annotations

import pytest
import torch
from hf_cases import TOKENS, hf_logits, save_hf_model
from safetensors.torch import load_file, save_file

import blockzoo
from blockzoo.api import Distributed, DistributedConfig
from blockzoo_testing.distributed import run_distributed


def _ranks(hf_dir: str, expected_path: str, out_dir: str) -> None:
    with Distributed(DistributedConfig(tensor_parallel=2, backend="gloo")) as distributed:
        model = blockzoo.load(hf_dir, distributed=distributed)
        parameter = dict(model.named_parameters())["decoder.1.mlp.gate_up.weight"]
        assert parameter.shape[0] * 2 == parameter.meta.global_shape[0]  # each rank holds half the experts' rows
        with torch.no_grad():
            logits = model.eval()(TOKENS)
        torch.testing.assert_close(logits, load_file(expected_path)["logits"], atol=1e-4, rtol=1e-4)
        blockzoo.save(model, out_dir, format="qwen3_moe")


@pytest.mark.distributed
def test_tensor_parallel_load_and_save(tmp_path):
    model = save_hf_model("qwen3_moe", tmp_path / "hf")
    save_file({"logits": hf_logits(model)}, tmp_path / "expected.safetensors")
    run_distributed(2, _ranks, str(tmp_path / "hf"), str(tmp_path / "expected.safetensors"), str(tmp_path / "out"))
    original = load_file(tmp_path / "hf" / "model.safetensors")
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert saved.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(saved[name], tensor), name
