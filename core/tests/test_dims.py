"""Tensor dims: local sizes, sharding and reassembly, checked against slices of the global tensor."""

import pytest
import torch

from blockzoo.layers.dims import CompositeTensorDim, ConcatenatedTensorDim, TensorDim


def _shards(dim, tensor, dim_index, tp_size):
    return [dim.global_to_local(tensor, dim_index, rank, tp_size) for rank in range(tp_size)]


def test_local_size():
    assert TensorDim("hidden", 6).local_size(4) == 6
    assert TensorDim("heads", 6, parallel=True).local_size(3) == 2


def test_indivisible_split_names_the_dim():
    with pytest.raises(ValueError, match=r"tensor dim 'heads' of size 6 .* 4 tensor-parallel ranks"):
        TensorDim("heads", 6, parallel=True).local_size(4)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_plain_dim_shards_are_contiguous_chunks(tp_size):
    dim = TensorDim("features", 8, parallel=True)
    tensor = torch.randn(3, 8)
    shards = _shards(dim, tensor, 1, tp_size)
    for shard, expected in zip(shards, tensor.chunk(tp_size, dim=1), strict=True):
        torch.testing.assert_close(shard, expected, rtol=0, atol=0)
    torch.testing.assert_close(dim.merge_shards(shards, 1), tensor, rtol=0, atol=0)


def test_replicated_dim_is_whole_on_every_rank():
    dim = TensorDim("hidden", 5)
    tensor = torch.randn(5, 2)
    assert all(shard is tensor for shard in _shards(dim, tensor, 0, 4))
    assert dim.merge_shards([tensor, tensor.clone()], 0) is tensor
    assert dim.local_to_global(tensor, 0, None) is tensor


def test_composite_split_through_its_first_component():
    heads, head_size, tp_size = 4, 3, 2
    dim = CompositeTensorDim("query", [TensorDim("heads", heads, parallel=True), TensorDim("head_size", head_size)])
    assert (dim.global_size, dim.local_size(tp_size), dim.parallel) == (12, 6, True)
    tensor = torch.randn(12, 5)
    shards = _shards(dim, tensor, 0, tp_size)
    per_head = tensor.view(heads, head_size, 5)
    for rank, shard in enumerate(shards):
        expected = per_head[rank * 2 : (rank + 1) * 2].reshape(6, 5)
        torch.testing.assert_close(shard, expected, rtol=0, atol=0)
    torch.testing.assert_close(dim.merge_shards(shards, 0), tensor, rtol=0, atol=0)


def test_composite_split_through_an_inner_component():
    # Multi-query attention: the heads within a group are split, the group dim is not.
    groups, heads_per_group, tp_size = 2, 4, 4
    dim = CompositeTensorDim(
        "query", [TensorDim("groups", groups), TensorDim("heads_per_group", heads_per_group, parallel=True)]
    )
    tensor = torch.randn(7, groups * heads_per_group)
    shards = _shards(dim, tensor, 1, tp_size)
    grid = tensor.view(7, groups, heads_per_group)
    for rank, shard in enumerate(shards):
        torch.testing.assert_close(shard, grid[:, :, rank : rank + 1].reshape(7, groups), rtol=0, atol=0)
    torch.testing.assert_close(dim.merge_shards(shards, 1), tensor, rtol=0, atol=0)


def test_composite_with_two_split_components_is_refused():
    with pytest.raises(ValueError, match=r"'bad'.*only one component"):
        CompositeTensorDim("bad", [TensorDim("a", 2, parallel=True), TensorDim("b", 2, parallel=True)])


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_concatenated_dim_shards_each_component(tp_size):
    key, value = TensorDim("key", 8, parallel=True), TensorDim("value", 4, parallel=True)
    dim = ConcatenatedTensorDim("key_value", [key, value])
    tensor = torch.randn(12, 3)
    shards = _shards(dim, tensor, 0, tp_size)
    keys, values = tensor[:8].chunk(tp_size), tensor[8:].chunk(tp_size)
    for rank, shard in enumerate(shards):
        torch.testing.assert_close(shard, torch.cat([keys[rank], values[rank]]), rtol=0, atol=0)
    torch.testing.assert_close(dim.merge_shards(shards, 0), tensor, rtol=0, atol=0)


def test_concatenated_component_slices():
    dim = ConcatenatedTensorDim("key_value", [TensorDim("key", 8, parallel=True), TensorDim("value", 4, parallel=True)])
    assert dim.component_slices() == [slice(0, 8), slice(8, 12)]
    assert dim.component_slices(2) == [slice(0, 4), slice(4, 6)]
    assert dim.local_size(2) == 6


def test_concatenated_dim_refuses_mixed_components():
    with pytest.raises(ValueError, match=r"'kv'.*split \['key'\] and replicated \['value'\]"):
        ConcatenatedTensorDim("kv", [TensorDim("key", 4, parallel=True), TensorDim("value", 4)])


def test_concatenated_composites_round_trip():
    # Mamba-style in_proj: [z, x] each heads × head_size, split by heads.
    def heads_dim(name):
        return CompositeTensorDim(name, [TensorDim(f"{name}_heads", 4, parallel=True), TensorDim("head_size", 2)])

    dim = ConcatenatedTensorDim("in_proj", [heads_dim("z"), heads_dim("x")])
    tensor = torch.randn(5, 16)
    shards = _shards(dim, tensor, 1, 2)
    # Rank 1 holds heads 2-3 of z then heads 2-3 of x.
    torch.testing.assert_close(shards[1], torch.cat([tensor[:, 4:8], tensor[:, 12:16]], dim=1), rtol=0, atol=0)
    torch.testing.assert_close(dim.merge_shards(shards, 1), tensor, rtol=0, atol=0)
