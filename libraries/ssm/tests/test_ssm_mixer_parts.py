"""The pieces the Mamba mixers share besides the numerics: the group-major dims of the SSD mixers (checked against
the layout written out here: head h reads group h // (heads / groups), a rank holds whole groups), the generation
state's checks and zero convolution state, the config checks of heads and groups, and the convolution's checkpoint
names and shapes."""

from types import SimpleNamespace

import pytest
import torch

from blockzoo.api import ConversionError
from blockzoo.config import ConfigFieldError
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.config import BiasConfig, FillInitializationConfig
from blockzoo.layers.dims import TensorDim
from blockzoo_ssm import (
    CausalConvolution,
    ConvolutionConfig,
    GroupMajorDims,
    SSMState,
    check_groups_tensor_parallel,
    check_head_groups,
)
from blockzoo_ssm.conversion import convolution_weights

HEADS, GROUPS, HEAD_SIZE, STATE_SIZE = 6, 3, 2, 4


def _rank_groups(rank: int, tensor_parallel: int) -> list[int]:
    per_rank = GROUPS // tensor_parallel
    return list(range(rank * per_rank, (rank + 1) * per_rank))


@pytest.mark.parametrize("tensor_parallel", [1, 3])
def test_group_major_dims_give_each_rank_whole_groups_with_their_heads(tensor_parallel):
    dims = GroupMajorDims(heads=HEADS, groups=GROUPS, head_size=HEAD_SIZE, state_size=STATE_SIZE)
    heads_per_group = HEADS // GROUPS
    head_dim, inner_dim, state_dim = dims.heads("dt"), dims.inner("x"), dims.group_state("b")
    assert (head_dim.name, head_dim.global_size) == ("dt", HEADS)
    assert (inner_dim.global_size, state_dim.global_size) == (HEADS * HEAD_SIZE, GROUPS * STATE_SIZE)
    for rank in range(tensor_parallel):
        groups = _rank_groups(rank, tensor_parallel)
        heads = [head for head in range(HEADS) if head // heads_per_group in groups]
        channels = [head * HEAD_SIZE + channel for head in heads for channel in range(HEAD_SIZE)]
        states = [group * STATE_SIZE + entry for group in groups for entry in range(STATE_SIZE)]
        for dim, expected in ((head_dim, heads), (inner_dim, channels), (state_dim, states)):
            local = dim.global_to_local(torch.arange(dim.global_size), 0, rank, tensor_parallel)
            assert local.tolist() == expected
            assert dim.local_size(tensor_parallel) == len(expected)


def test_generation_state_checks_the_batch_it_continues():
    state = SSMState(torch.zeros(2, 5, 3), torch.zeros(2, 4))
    state.check(SimpleNamespace(past_lengths=torch.zeros(2), num_documents=2), "mamba_2 'mixer'")
    with pytest.raises(ValueError, match=r"^mamba_2 'mixer': a generation state needs `batch\.past_lengths`$"):
        state.check(SimpleNamespace(past_lengths=None, num_documents=2), "mamba_2 'mixer'")
    with pytest.raises(ValueError, match=r"^m 'x': the batch has 1 sequences but the state holds 2$"):
        state.check(SimpleNamespace(past_lengths=torch.zeros(1), num_documents=1), "m 'x'")


def test_the_convolution_state_starts_at_zero_with_one_input_less_than_the_window():
    distributed = Distributed(DistributedConfig(seed=5, backend="gloo"), world_size=1, rank=0, local_rank=0)
    convolution = CausalConvolution(
        ConvolutionConfig(kernel_size=4),
        name="mixer.convolution",
        channels_dim=TensorDim("channels", 5),
        distributed=distributed,
        lr_scale=1.0,
        bias_initialization=FillInitializationConfig(value=0.0),
    )
    state = convolution.new_state(3, torch.device("cpu"), torch.bfloat16)
    assert state.shape == (3, 5, 3) and state.dtype == torch.bfloat16 and not state.any()


def test_head_and_group_checks_name_the_groups_field():
    check_head_groups(6, 3)
    check_groups_tensor_parallel(4, 2)
    for call, message in (
        (lambda: check_head_groups(2, 4), "must be <= heads (2), got 4"),
        (lambda: check_head_groups(6, 4), "must divide heads (6), got 4"),
        (lambda: check_groups_tensor_parallel(3, 2), "tensor_parallel=2 must divide groups (3): heads and their B/C"),
    ):
        with pytest.raises(ConfigFieldError) as error:
            call()
        assert error.value.field_name == "groups" and error.value.message.startswith(message)


def test_the_convolution_converts_to_and_from_conv1d_filters():
    """Against torch's own depthwise Conv1d: its weight [channels, 1, kernel] is our filters [channels, kernel]."""
    conv1d = torch.nn.Conv1d(5, 5, kernel_size=4, groups=5)
    filters, bias = convolution_weights(ConvolutionConfig(kernel_size=4))
    assert (filters.ours, filters.theirs, bias.ours, bias.theirs) == (
        ("convolution.weight",),
        ("conv1d.weight",),
        ("convolution.bias",),
        ("conv1d.bias",),
    )
    (ours,) = filters.import_tensors([conv1d.weight.detach()])
    assert ours.shape == (5, 4)
    torch.testing.assert_close(filters.export_tensors([ours])[0], conv1d.weight.detach(), rtol=0, atol=0)
    without_bias = convolution_weights(ConvolutionConfig(bias=BiasConfig(enabled=False)))
    assert [mapping.ours for mapping in without_bias] == [("convolution.weight",)]
    with pytest.raises(ConversionError, match=r"conv1d\.weight of shape \[5, 4\]: expected \[channels, 1, kernel"):
        filters.import_tensors([ours])
