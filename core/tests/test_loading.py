"""Loading reads each tensor once from a memory-mapped file: the mapped views hold the file's bytes, writing to them
never changes the file, and `blockzoo.loading` either makes a parameter the view (held whole, same dtype) or copies
this rank's part into it (cast on the way), a concatenated weight part by part. References: the tensors as saved,
`SafetensorsReader.read` (a plain file read) and `torch.cat`."""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch import nn

from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.runtime import Distributed
from blockzoo.loading import fill_concatenated, fill_parameter
from blockzoo.safetensors_io import SafetensorsReader, SafetensorsWriter

ALONE = Distributed(DistributedConfig(), world_size=1, rank=0)


@pytest.fixture
def saved(tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(3, 4, generator=generator),
        "b": torch.randn(5, 4, generator=generator),
        "c": torch.randn(2, 4, generator=generator).to(torch.bfloat16),
        "d": torch.randn(6, generator=generator),
        "empty": torch.empty(0, 4),
    }
    path = tmp_path / "tensors.safetensors"
    with SafetensorsWriter(path, {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
    return path, tensors


def test_mapped_tensors_are_the_file_and_writing_them_leaves_it_alone(saved):
    path, tensors = saved
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    with SafetensorsReader(path) as reader:
        views = {name: reader.mapped(name) for name in tensors}
        for name, tensor in tensors.items():
            assert views[name].dtype == tensor.dtype and torch.equal(views[name], reader.read(name))
            assert torch.equal(views[name], tensor)
    # Still valid once the reader is closed; private: the file keeps its bytes.
    views["a"].add_(1.0)
    assert torch.equal(views["a"], tensors["a"] + 1.0)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before


def test_a_run_of_consecutive_tensors_is_one_view_and_other_runs_are_none(saved):
    path, tensors = saved
    with SafetensorsReader(path) as reader:
        run = reader.mapped_run(["a", "b"])
        assert torch.equal(run, torch.cat([tensors["a"], tensors["b"]]))
        assert run.untyped_storage().data_ptr() == reader.mapped_file().untyped_storage().data_ptr()
        assert reader.mapped_run(["b", "a"]) is None  # not in file order
        assert reader.mapped_run(["b", "c"]) is None  # another dtype
        assert reader.mapped_run(["c", "d"]) is None  # other trailing dims


def test_a_parameter_held_whole_becomes_the_view_else_gets_a_cast_copy(saved):
    path, tensors = saved
    with SafetensorsReader(path) as reader:
        same = nn.Parameter(torch.empty(3, 4))
        fill_parameter(same, reader.mapped("a"), ALONE, adopt=True)
        assert same.data_ptr() == reader.mapped("a").data_ptr() and same.requires_grad
        assert torch.equal(same, tensors["a"])

        cast = nn.Parameter(torch.empty(3, 4, dtype=torch.bfloat16))
        fill_parameter(cast, reader.mapped("a"), ALONE, adopt=True)
        assert cast.dtype == torch.bfloat16 and torch.equal(cast, tensors["a"].to(torch.bfloat16))

        copied = nn.Parameter(torch.empty(3, 4))
        fill_parameter(copied, reader.mapped("a"), ALONE, adopt=False)
        assert copied.data_ptr() != reader.mapped("a").data_ptr() and torch.equal(copied, tensors["a"])


@pytest.mark.parametrize("transposed", [False, True])
def test_concatenated_parts_are_copied_into_their_rows(saved, transposed):
    path, tensors = saved
    with SafetensorsReader(path) as reader:
        parts = [reader.mapped("a"), reader.mapped("b")]
        if transposed:
            parts = [part.t().contiguous() for part in parts]
        parameter = nn.Parameter(torch.empty(8, 4))
        fill_concatenated(parameter, parts, ALONE, transposed=transposed)
        assert torch.equal(parameter, torch.cat([tensors["a"], tensors["b"]]))
        run = nn.Parameter(torch.empty(8, 4))
        fill_concatenated(run, parts, ALONE, transposed=transposed, run=reader.mapped_run(["a", "b"]))
        assert torch.equal(run, parameter) and run.data_ptr() == reader.mapped("a").data_ptr()
