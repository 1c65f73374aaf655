"""Tensor-parallel and sequence-tensor-parallel Mamba equal the single-process run (outputs and all gradients),
and so does tensor-parallel generation: the conformance kit's `check_tensor_parallel`, on cases of both layouts, in
one set of 2 gloo processes. The standard layout's row-parallel x_proj (with a bias) and its dt/B/C norms on the
residual-stream layout; the grouped one's heads split with the x/B heads they read, its B/C norms inside the tensor
region (partial gradients), the convolution before and after the head repetition. x/B heads the ranks do not divide
are refused.
"""

import pytest
from mamba_reference import SEED

from blockzoo_mamba.config import MambaConfig
from blockzoo_testing import check_tensor_parallel

RANDOM_BIAS = {"bias": {"initialization": {"type": "normal", "std": 0.5}}}
RANDOM_NORM = {"type": "rms_norm", "weight": {"initialization": {"type": "normal", "mean": 1.0, "std": 0.3}}}
NORMS = {"dt_norm": RANDOM_NORM, "b_norm": RANDOM_NORM, "c_norm": RANDOM_NORM}
CASES = {
    "standard-biases-norms": {
        "state_size": 4,
        "inner_size": 24,
        "dt_rank": 3,
        "add_linear_biases": True,
        "x": RANDOM_BIAS,
        "out_proj": RANDOM_BIAS,
        "x_proj": {"bias": {"enabled": True, "initialization": {"type": "normal", "std": 0.5}}},
        "convolution": {"kernel_size": 3, **RANDOM_BIAS},
        **NORMS,
    },
    "grouped-repeat-before-norms": {
        "state_size": 4,
        "inner_size": 32,
        "xb_size": 16,
        "dt_rank": 2,
        "add_linear_biases": True,
        "b": RANDOM_BIAS,
        "dt_in_proj": RANDOM_BIAS,
        "out_proj": RANDOM_BIAS,
        **NORMS,
    },
    "grouped-repeat-after": {
        "state_size": 4,
        "inner_size": 48,
        "xb_size": 8,
        "repeat_xb_before_convolution": False,
        "convolution": RANDOM_BIAS,
        "b_norm": RANDOM_NORM,
    },
}
REFUSED = [
    (
        {"state_size": 4, "xb_size": 4, "expand": 1},
        r"mixer 'mixer' \(type 'mamba'\): xb_size: tensor_parallel=2 must divide the x/B heads",
    )
]


@pytest.mark.distributed
def test_tensor_parallel_matches_single_process():
    check_tensor_parallel(MambaConfig, CASES, lengths=[5, 3, 4], seed=SEED, refused=REFUSED)
