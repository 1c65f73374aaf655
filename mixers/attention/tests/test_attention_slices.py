"""Attention over slices of sequences (`forward_slice`): slices one after the other, each taking the previous carry,
give the whole forward (outputs, every gradient) for causal, windowed, GQA and MQA attention, every rotary type and
the flex kernel; the carry of windowed attention keeps only the window; non-causal attention is refused over slices.
Over sequence-data groups on gloo: the kit's check (test_attention_conformance.py) and
tests/test_sequence_data_parallel.py. On a GPU: the kernels over slices against their whole forward."""

import pytest
import torch
from attention_reference import SEED, build

from blockzoo.config import ConfigError, structure
from blockzoo.layers.base import Batch, slice_batch
from blockzoo.run_config import RunConfig
from blockzoo_testing import check_forward_slices, forward_over_slices, layer_inputs, single_process

TOLERANCE = {"atol": 2e-5, "rtol": 1e-5}
# 24 tokens: a document longer than several slices, one of a single token, documents ending on slice boundaries.
LENGTHS = [11, 1, 4, 8]
SMALL = {"heads": 4, "head_size": 8}
CASES = {
    "mha": SMALL,
    "gqa-window-2": {**SMALL, "head_groups": 2, "window_size": 2},
    "mqa-window-7-norms": {**SMALL, "head_groups": 1, "window_size": 7, "key_norm": {"type": "rms_norm"}},
    "gqa-llama3-biases": {
        **SMALL,
        "head_groups": 2,
        "add_linear_biases": True,
        "rotary": {"type": "llama3", "theta": 100.0, "original_context_length": 8, "scale_factor": 4.0},
    },
    "nope-window-30": {**SMALL, "rotary": {"type": "none"}, "window_size": 30},
    "partial-rotary": {**SMALL, "rotary": {"type": "partial", "fraction": 0.5}},
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("slice_length", [1, 3, 8, 12])
def test_slices_one_after_the_other_give_the_whole_forward(case, slice_length):
    check_forward_slices(build(CASES[case]), lengths=LENGTHS, slice_length=slice_length, tolerance=TOLERANCE)


def test_the_flex_kernel_over_slices_gives_the_whole_forward():
    layer = build({**CASES["gqa-window-2"], "implementation": "flex"})
    reference = build(CASES["gqa-window-2"])
    hidden, _ = layer_inputs(sum(LENGTHS), layer.hidden_dim.global_size)
    output, _ = forward_over_slices(layer, hidden, LENGTHS, 6)  # no gradients: FlexAttention has no CPU backward
    with torch.no_grad():
        torch.testing.assert_close(output, reference(hidden, Batch(LENGTHS)), **TOLERANCE)


def test_the_carry_of_windowed_attention_keeps_the_window_only():
    layer = build(CASES["gqa-window-2"])
    hidden, _ = layer_inputs(sum(LENGTHS), layer.hidden_dim.global_size)
    carry = None
    for start in range(0, sum(LENGTHS), 3):
        _, carry = layer.forward_slice(hidden[start : start + 3], slice_batch(LENGTHS, start, start + 3), carry)
        assert carry.tokens == 1  # a query sees itself and one token before it
    _, unwindowed = build(SMALL).forward_slice(hidden[:3], slice_batch(LENGTHS, 0, 3), None)
    assert unwindowed.tokens == 3


def test_non_causal_attention_is_refused_over_slices():
    data = {
        "model": {"decoder": {"block": {"mixer": {"type": "attention", "causal": False}, "mlp": {"type": "none"}}}},
        "distributed": {"micro_sequence_length": 4},
        "data": {"type": "random", "sequence_length": 16},
    }
    with pytest.raises(ConfigError, match=r"model\.decoder\.block\.mixer\.causal: attention over slices of sequences"):
        structure(data, RunConfig)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("implementation", ["varlen", "batched", "torch"])
@pytest.mark.parametrize("case", ["gqa-window-2", "gqa-llama3-biases"])
def test_gpu_kernels_over_slices_give_their_whole_forward(implementation, case):
    """bf16 on CUDA: varlen's segments of keys (bottom-right causal alignment) against the same kernel's whole
    forward; relative tolerances as test_attention_gpu.py's."""
    distributed = single_process(SEED, backend="nccl", compute_dtype="bf16")
    layer = build({**CASES[case], "implementation": implementation}, distributed, hidden=64)
    lengths = [37, 1, 90, 128]
    check_forward_slices(layer, lengths=lengths, slice_length=64, tolerance={"relative": 3e-2}, dtype=torch.bfloat16)
