"""The checks every format's tests run on its cases: import gives transformers' logits, export reloads in transformers
with ours, and both round trips (Hugging Face → blockzoo → Hugging Face, blockzoo → Hugging Face → blockzoo) are
identical. Each takes a case's checkpoint directory and format name; what a format does not carry is the caller's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from hf_cases import hf_logits, load_hf, our_logits, transformers_model
from safetensors.torch import load_file

import blockzoo
from blockzoo.config import to_dict
from blockzoo.model.config import ModelConfig
from blockzoo.model.factory import convert
from blockzoo_huggingface import versions

TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}
# Keys every export writes anew: the writing transformers version and the dtype of the tensors.
REWRITTEN = {"transformers_version", "dtype"}


def saved_transformers_cases(tmp_path_factory, cases: dict) -> dict[str, tuple[Path, torch.Tensor]]:
    """case -> (directory of its saved transformers model, that model's logits), for cases of
    (format, transformers config class name, config)."""
    saved = {}
    for case, (_, class_name, config) in cases.items():
        directory = tmp_path_factory.mktemp(case)
        model = transformers_model(class_name, config)
        model.save_pretrained(directory)
        saved[case] = (directory, hf_logits(model))
    return saved


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def read_config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


def with_config(directory: Path, copy: Path, config: dict) -> Path:
    """A copy of the checkpoint in `directory` with this config.json."""
    shutil.copytree(directory, copy)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def comparable(config: dict) -> dict:
    """The 5.x form of a config, without the keys every export writes anew."""
    return {key: value for key, value in versions.standardize(config, None).items() if key not in REWRITTEN}


def random_model(config: ModelConfig, seed: int):
    """A blockzoo model of the architecture with blockzoo's own random weights, not transformers'."""
    return blockzoo.build({"model": to_dict(config), "distributed": {"seed": seed}})


def check_import(directory: Path, expected_logits: torch.Tensor) -> None:
    torch.testing.assert_close(our_logits(blockzoo.load(directory)), expected_logits, **TOLERANCE)


def check_export(directory: Path, format_name: str, tmp_path: Path) -> None:
    model = random_model(blockzoo.load(directory).config, seed=7)
    blockzoo.save(model, tmp_path / "hf", format=format_name)
    torch.testing.assert_close(hf_logits(load_hf(tmp_path / "hf")), our_logits(model), **TOLERANCE)


def check_huggingface_round_trip(directory: Path, format_name: str, tmp_path: Path, expected_config: dict) -> None:
    """Written again, through a native checkpoint (streaming) and through a model in memory: the same tensors, the
    same blockzoo config, a config.json whose `comparable` form is `expected_config` (the original's, in the form
    the export writes: the keys no field holds, token ids and the like, come back from the original), and the same
    other files (transformers writes generation_config.json)."""
    convert(directory, tmp_path / "native")
    convert(tmp_path / "native", tmp_path / "streamed", format=format_name)
    blockzoo.save(blockzoo.load(directory), tmp_path / "saved", format=format_name)
    original = read_tensors(directory)
    for written in ("streamed", "saved"):
        tensors = read_tensors(tmp_path / written)
        assert tensors.keys() == original.keys()
        for name, tensor in original.items():
            assert torch.equal(tensors[name], tensor), name
        assert comparable(read_config(tmp_path / written)) == expected_config
        assert blockzoo.load(tmp_path / written).config == blockzoo.load(directory).config
        for path in directory.iterdir():
            if path.name != "config.json" and "safetensors" not in path.name:
                assert (tmp_path / written / path.name).read_bytes() == path.read_bytes(), path.name


def check_blockzoo_round_trip(directory: Path, format_name: str, tmp_path: Path) -> None:
    model = random_model(blockzoo.load(directory).config, seed=3)
    blockzoo.save(model, tmp_path / "hf", format=format_name)
    loaded = blockzoo.load(tmp_path / "hf")
    assert loaded.config == model.config
    parameters = dict(model.named_parameters())
    assert {name for name, _ in loaded.named_parameters()} == parameters.keys()
    for name, parameter in loaded.named_parameters():
        assert torch.equal(parameter, parameters[name]), name
