"""MLA over slices of sequences (`forward_slice`): micro-sequences one after the other, each attending to the latents
carried from the earlier ones, give the whole forward (outputs, input and every parameter gradient); the carry holds
the compressed tokens only (latent ‖ rotary key part, never keys and values); under sequence-data parallelism on gloo
each rank's outputs and input gradient are the single process's for its tokens and the parameter gradients summed
over the ranks are the single process's (`blockzoo_testing.check_sequence_data_parallel`), over 2 ranks here and 4
(slow), one slice a rank and in micro-sequences; the flex kernel over slices (forward only on the CPU). The kit's own
layouts run in test_mla_conformance.py.

The 24 tokens: documents of 7, 1, 3, 9, 1 and 3 tokens. Over 4 ranks (slices of 6) documents straddle two
boundaries, the slice [12, 18) lies inside the 9-token document (its queries see the previous rank's latents), a
one-token document sits inside a slice; micro-sequences of 2 put boundaries on document boundaries (8, 20) and make
the third rank of the second step see latents of the first step. Over 2 ranks (slices of 12) the boundary cuts the
9-token document; micro-sequences of 3 end one chunk on the boundary at 21.
"""

import pytest
import torch
from mla_reference import RANDOM_BIAS, RANDOM_NORM, SMALL, build

from blockzoo.layers.base import Batch, slice_batch
from blockzoo_mla.config import MLAConfig
from blockzoo_testing import check_forward_slices, check_sequence_data_parallel, forward_over_slices, layer_inputs

TOLERANCE = {"atol": 2e-5, "rtol": 1e-5}
LENGTHS = (7, 1, 3, 9, 1, 3)
CASES = {
    "plain-query": {**SMALL},
    "low-rank-query-interleaved-norms": {
        **SMALL,
        "query_rank": 12,
        "query_norm": RANDOM_NORM,
        "key_value_norm": RANDOM_NORM,
        "interleaved_rotary": True,
        "rotary": {"type": "default", "theta": 100.0},
    },
    "biases-nope-scale": {
        **SMALL,
        "query_rank": 12,
        "add_linear_biases": True,
        "key_value_down": RANDOM_BIAS,
        "key_value_up": RANDOM_BIAS,
        "rotary": {"type": "none"},
        "softmax_scale": 0.7,
    },
    "value-wider-than-query-key": {**SMALL, "nope_head_size": 2, "value_head_size": 9, "rotary": {"theta": 50.0}},
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("slice_length", [1, 3, 8, 12])
def test_micro_sequences_one_after_the_other_give_the_whole_forward(case, slice_length):
    check_forward_slices(build(CASES[case]), lengths=LENGTHS, slice_length=slice_length, tolerance=TOLERANCE)


def test_the_carry_holds_every_token_s_compressed_latent_only():
    layer = build(CASES["low-rank-query-interleaved-norms"])
    hidden, _ = layer_inputs(sum(LENGTHS), layer.hidden_dim.global_size)
    carry = None
    for start in range(0, sum(LENGTHS), 6):
        _, carry = layer.forward_slice(hidden[start : start + 6], slice_batch(LENGTHS, start, start + 6), carry)
        assert carry.tokens == start + 6
    compressed = torch.cat(carry.blocks)
    # key_value_rank + rotary_head_size numbers a token: the normalized latent, then the rotated shared key part.
    assert compressed.shape == (sum(LENGTHS), 8 + 4)
    latent, _ = layer.key_value_down(hidden).split([8, 4], dim=-1)
    torch.testing.assert_close(compressed[:, :8], layer.key_value_norm(latent))


def test_the_flex_kernel_over_slices_gives_the_whole_forward():
    layer = build({**CASES["value-wider-than-query-key"], "implementation": "flex"})  # padded value heads too
    reference = build(CASES["value-wider-than-query-key"])
    hidden, _ = layer_inputs(sum(LENGTHS), layer.hidden_dim.global_size)
    output, _ = forward_over_slices(layer, hidden, LENGTHS, 6)  # no gradients: FlexAttention has no CPU backward
    with torch.no_grad():
        torch.testing.assert_close(output, reference(hidden, Batch(LENGTHS)), **TOLERANCE)


def test_a_slice_whose_carry_is_missing_is_refused():
    layer = build(SMALL)
    hidden, _ = layer_inputs(sum(LENGTHS), layer.hidden_dim.global_size)
    # Tokens [9, 12) continue the 9-token document begun at 11: fine. [12, 15) without the carry of [0, 12): refused.
    with pytest.raises(ValueError, match=r"continues a document begun 1 tokens before it, but only 0 come before"):
        layer.forward_slice(hidden[12:15], slice_batch(LENGTHS, 12, 15), None)


def _sequence_data_parallel(size: int, micro_sequence_length: int) -> None:
    check_sequence_data_parallel(
        MLAConfig,
        {name: {"type": "mla", **case} for name, case in CASES.items()},
        lengths=LENGTHS,
        sequence_data_parallel=size,
        micro_sequence_lengths=(None, micro_sequence_length),
        tolerance=TOLERANCE,
    )


@pytest.mark.distributed
def test_two_ranks_match_one_process():
    _sequence_data_parallel(2, 3)


@pytest.mark.slow
@pytest.mark.distributed
def test_four_ranks_match_one_process():
    _sequence_data_parallel(4, 2)
