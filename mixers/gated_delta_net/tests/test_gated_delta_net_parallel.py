"""Tensor-parallel and sequence-tensor-parallel Gated DeltaNet equal the single-process run (outputs and gradients),
and so does tensor-parallel decoding: the conformance kit's `check_tensor_parallel`, on one and two key heads per
rank, in one set of two gloo processes. Key heads the ranks do not divide are refused."""

import pytest
from gated_delta_net_reference import AROUND_ONE, RANDOM, SEED, STRONG_DECAY

from blockzoo_gated_delta_net.config import GatedDeltaNetConfig
from blockzoo_testing import check_tensor_parallel

CASES = {
    "one-key-head-per-rank-grouped-values": {
        "key_heads": 2,
        "value_heads": 4,
        "key_head_size": 4,
        "value_head_size": 3,
        "chunk_size": 4,
        **STRONG_DECAY,
        "convolution": {"kernel_size": 3, "bias": {"enabled": True, **RANDOM}},
        "normalization": {"weight": AROUND_ONE},
    },
    "two-key-heads-per-rank-biases": {
        "key_heads": 4,
        "value_heads": 4,
        "key_head_size": 2,
        "value_head_size": 2,
        "chunk_size": 3,
        **STRONG_DECAY,
        "add_linear_biases": True,
        "z": {"bias": RANDOM},
        "a": {"bias": RANDOM},
        "out_proj": {"bias": RANDOM},
    },
}
REFUSED = [
    (
        {"key_heads": 1, "value_heads": 2, "key_head_size": 4, "value_head_size": 4},
        r"mixer 'mixer' \(type 'gated_delta_net'\): key_heads: tensor_parallel=2 must divide key_heads",
    )
]


@pytest.mark.distributed
def test_tensor_parallel_matches_single_process():
    check_tensor_parallel(GatedDeltaNetConfig, CASES, lengths=[5, 3, 4], seed=SEED, refused=REFUSED)
