"""Tensor-parallel and sequence-tensor-parallel discrete Mamba 2 equal the single-process run (outputs, the input
gradient and every parameter's gradient assembled to its global tensor), and so does tensor-parallel decoding: the
conformance kit's `check_tensor_parallel`, in one set of two gloo processes. Cases: several groups per rank and
several heads per group, with z_bias (no in_proj bias) or with biases. Groups the ranks do not divide are refused;
every parameter but the output bias is split between the ranks.
"""

import pytest
from dm2_reference import RANDOM, RANDOM_BIAS, SEED, build

from blockzoo_discrete_mamba_2.config import DiscreteMamba2Config
from blockzoo_testing import check_tensor_parallel

CASES = {
    "z-bias-silu": {
        "heads": 8,
        "groups": 4,
        "head_size": 3,
        "state_size": 4,
        "chunk_size": 4,
        "activation": "silu",
        "z_bias": RANDOM,
        "d": RANDOM,
    },
    "biases-kernel-3": {
        "heads": 4,
        "groups": 2,
        "head_size": 4,
        "state_size": 3,
        "chunk_size": 3,
        "convolution": {"kernel_size": 3, "bias": RANDOM},
        "add_linear_biases": True,
        **{name: RANDOM_BIAS for name in ("x", "b", "c", "z", "dt", "out_proj")},
    },
}
REFUSED = [({"heads": 4, "groups": 1, "head_size": 2}, r"tensor_parallel=2 must divide groups \(1\)")]


@pytest.mark.distributed
def test_tensor_parallel_matches_single_process():
    # 14 tokens: sequence-tensor-parallel gives each of the 2 ranks 7.
    check_tensor_parallel(DiscreteMamba2Config, CASES, lengths=[5, 3, 6], seed=SEED, refused=REFUSED)


@pytest.mark.parametrize("case", CASES)
def test_every_parameter_but_the_output_bias_is_split(case):
    layer = build(CASES[case])
    replicated = {name for name, parameter in layer.named_parameters() if not parameter.meta.tensor_parallel}
    assert replicated <= {"out_proj.bias"}
