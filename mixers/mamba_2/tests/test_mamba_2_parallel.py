"""Tensor-parallel and sequence-tensor-parallel Mamba 2 equal the single-process run (outputs and gradients), and so
does tensor-parallel decoding: the conformance kit's `check_tensor_parallel`, on one and two groups per rank and the
output norm's variants, in one set of two gloo processes. Groups the ranks do not divide are refused."""

import pytest
from mamba_2_reference import AROUND_ONE, RANDOM, SEED

from blockzoo_mamba_2.config import Mamba2Config
from blockzoo_testing import check_tensor_parallel

LARGE_DT = {"dt_bias": {"initialization": {"type": "normal", "std": 1.0}}}
CASES = {
    "one-group-per-rank": {
        "heads": 4,
        "head_size": 4,
        "groups": 2,
        "state_size": 3,
        "chunk_size": 4,
        **LARGE_DT,
        "convolution": {"kernel_size": 3, "bias": RANDOM},
        "normalization": {"weight": AROUND_ONE},
        "d": AROUND_ONE,
    },
    "two-groups-per-rank-biases-d-per-channel": {
        "heads": 8,
        "head_size": 2,
        "groups": 4,
        "state_size": 2,
        "chunk_size": 3,
        **LARGE_DT,
        "add_linear_biases": True,
        "z": {"bias": RANDOM},
        "b": {"bias": RANDOM},
        "dt": {"bias": RANDOM},
        "out_proj": {"bias": RANDOM},
        "d_per_channel": True,
        "d": RANDOM,
        "dt_limit": [0.1, 2.0],
    },
    # The output norm's variants: normalize, then gate (per-group statistics, as the gated norm); no norm, where
    # per_group false splits nothing (there are no statistics).
    "norm-before-gate": {
        "heads": 4,
        "head_size": 4,
        "groups": 2,
        "state_size": 3,
        "chunk_size": 4,
        **LARGE_DT,
        "normalization": {"norm_before_gate": True, "weight": AROUND_ONE},
    },
    "no-norm": {
        "heads": 4,
        "head_size": 4,
        "groups": 2,
        "state_size": 3,
        "chunk_size": 4,
        **LARGE_DT,
        "normalization": {"enabled": False, "per_group": False},
    },
}
REFUSED = [
    (
        {"heads": 4, "head_size": 4, "groups": 1},
        r"mixer 'mixer' \(type 'mamba_2'\): groups: tensor_parallel=2 must divide groups",
    )
]


@pytest.mark.distributed
def test_tensor_parallel_matches_single_process():
    check_tensor_parallel(Mamba2Config, CASES, lengths=[5, 3, 4], seed=SEED, refused=REFUSED)
