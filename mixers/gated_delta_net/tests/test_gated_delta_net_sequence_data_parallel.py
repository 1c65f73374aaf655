"""The Gated DeltaNet mixer under sequence-data parallelism, on gloo: each rank's outputs and input gradient are the
single process's for its tokens, and the parameter gradients summed over the ranks are the single process's
(`blockzoo_testing.check_sequence_data_parallel`), over 2 and 4 ranks, one slice a rank and in micro-sequence chunks
(the delta rule's state and the convolution's inputs carried from chunk to chunk as well as between ranks).

The 24 tokens: documents of 7, 1, 3, 9, 1 and 3 tokens. Over 4 ranks (slices of 6) documents straddle two
boundaries, the slice [12, 18) lies inside one document (its state map A·S + B is composed with the others', not
cut), and a one-token document sits inside a slice; micro-sequences of 2 put boundaries on document boundaries and
make slices shorter than the convolution's kernel_size − 1. Over 2 ranks (slices of 12) the boundary cuts the
9-token document; micro-sequences of 3 end one chunk on the boundary at 21. The kit's own layouts (every slice
continuing a document) run in the conformance test."""

import pytest
from gated_delta_net_reference import AROUND_ONE, STRONG_DECAY

from blockzoo_gated_delta_net.config import GatedDeltaNetConfig
from blockzoo_testing import check_sequence_data_parallel

LENGTHS = (7, 1, 3, 9, 1, 3)
CASES = {
    "grouped-values-strong-decay": {
        "type": "gated_delta_net",
        "key_heads": 2,
        "value_heads": 4,
        "key_head_size": 4,
        "value_head_size": 3,
        "chunk_size": 4,
        **STRONG_DECAY,
        "normalization": {"weight": AROUND_ONE},
    },
    "conv-bias-kernel-2-long-chunks": {
        "type": "gated_delta_net",
        "key_heads": 1,
        "value_heads": 2,
        "key_head_size": 5,
        "value_head_size": 4,
        "chunk_size": 64,
        "convolution": {"kernel_size": 2, "bias": {"enabled": True}},
    },
}
# fp32, strong decays: the parameter gradients (up to ~80) differ from one process's by ~2e-6 of their norms.
TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}
PARAMETER_GRADIENT_TOLERANCE = {"atol": 5e-4, "rtol": 2e-4}


@pytest.mark.distributed
@pytest.mark.parametrize(("size", "micro_sequence_length"), [(2, 3), (4, 2)])
def test_gated_delta_net_matches_one_process(size, micro_sequence_length):
    check_sequence_data_parallel(
        GatedDeltaNetConfig,
        CASES,
        lengths=LENGTHS,
        sequence_data_parallel=size,
        micro_sequence_lengths=(None, micro_sequence_length),
        tolerance=TOLERANCE,
        parameter_gradient_tolerance=PARAMETER_GRADIENT_TOLERANCE,
    )
