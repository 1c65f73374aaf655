"""`blockzoo.load` of a Hugging Face directory reads each tensor once from the memory-mapped shards: the parameters
are those of the plain-read conversion path (`convert`: file reads, `torch.cat`) and the model computes
transformers' logits; a parameter whose tensor (or whose parts, end to end) the file holds as it is becomes a view
of the mapped file, the others are copies. transformers' files sort their tensors by name, so gate‖up lie end to end
there and key‖value do not."""

from __future__ import annotations

import torch
from hf_cases import hf_logits, our_logits, save_hf_model
from safetensors.torch import load_file

import blockzoo
from blockzoo.model.factory import convert
from blockzoo.safetensors_io import SafetensorsReader


def _mapped(parameter: torch.Tensor, file_size: int) -> bool:
    # A view of the mapped file: its storage is the whole file.
    return parameter.untyped_storage().nbytes() == file_size


def test_a_transformers_directory_loads_mapped_into_the_conversion_paths_parameters(tmp_path):
    reference = save_hf_model("llama_llama3", tmp_path / "hf")
    model = blockzoo.load(tmp_path / "hf")
    torch.testing.assert_close(our_logits(model), hf_logits(reference), atol=1e-4, rtol=1e-4)

    convert(tmp_path / "hf", tmp_path / "native")  # plain reads and torch.cat
    expected = load_file(tmp_path / "native" / "model.safetensors")
    parameters = dict(model.named_parameters())
    assert parameters.keys() == expected.keys()
    for name, parameter in parameters.items():
        assert torch.equal(parameter, expected[name]), name

    path = tmp_path / "hf" / "model.safetensors"
    mapped = {name for name, parameter in parameters.items() if _mapped(parameter, path.stat().st_size)}
    assert "decoder.0.mixer.query.weight" in mapped  # one tensor, as it is
    assert "decoder.0.mixer.key_value.weight" not in mapped  # k_proj, o_proj, q_proj, v_proj: copied
    # gate‖up: a view when the file holds them end to end (sorted names: not with the biases between them)
    with SafetensorsReader(path) as reader:
        prefix = "model.layers.0.mlp"
        gate, up = (reader.entries[f"{prefix}.{part}_proj.weight"]["data_offsets"] for part in ("gate", "up"))
    assert ("decoder.0.mlp.gate_up.weight" in mapped) == (gate[1] == up[0])


def test_an_export_holds_concatenated_parts_end_to_end_and_loads_as_views_only(tmp_path):
    save_hf_model("llama_llama3", tmp_path / "hf")
    blockzoo.save(blockzoo.load(tmp_path / "hf"), tmp_path / "ours", format="llama")
    model = blockzoo.load(tmp_path / "ours")
    size = (tmp_path / "ours" / "model.safetensors").stat().st_size
    assert all(_mapped(parameter, size) for parameter in model.parameters())
    expected = load_file(tmp_path / "hf" / "model.safetensors")
    assert load_file(tmp_path / "ours" / "model.safetensors").keys() == expected.keys() - {"lm_head.weight"}


def test_training_a_loaded_model_never_writes_to_its_files(tmp_path):
    save_hf_model("llama_llama3", tmp_path / "hf")
    before = (tmp_path / "hf" / "model.safetensors").read_bytes()
    model = blockzoo.load(tmp_path / "hf")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == before
    again = blockzoo.load(tmp_path / "hf")
    for (name, changed), (_, loaded) in zip(model.named_parameters(), again.named_parameters(), strict=True):
        assert torch.equal(changed, loaded + 1.0), name
