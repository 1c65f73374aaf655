"""Tensor-parallel and sequence-tensor-parallel attention equal the single-process run (outputs and gradients), and
so does tensor-parallel KV-cache decoding: the conformance kit's `check_tensor_parallel`, one set of gloo processes
per world size. Cases cover split head groups (GQA), split heads with replicated key/value (MQA, and fewer groups
than ranks), biases and per-head norms (replicated parameters whose gradients are partial per rank). Head groups
that 4 ranks cannot split, nor the heads of each group, are refused.
"""

import pytest
from attention_reference import SEED

from blockzoo_attention.config import AttentionConfig
from blockzoo_testing import check_tensor_parallel

RANDOM_BIAS = {"bias": {"initialization": {"type": "normal", "std": 0.5}}}
RANDOM_NORM = {"type": "rms_norm", "weight": {"initialization": {"type": "normal", "mean": 1.0, "std": 0.3}}}
BIASES = {"add_linear_biases": True, "query": RANDOM_BIAS, "key": RANDOM_BIAS, "value": RANDOM_BIAS}
CASES = {
    2: {
        "gqa-norms-qkv-biases": {
            "heads": 4,
            "head_groups": 2,
            "head_size": 8,
            **BIASES,
            "dense": {"bias": {"enabled": False}},
            "query_norm": RANDOM_NORM,
            "key_norm": RANDOM_NORM,
        },
        "mqa-window-llama3": {
            "heads": 4,
            "head_groups": 1,
            "head_size": 8,
            **BIASES,
            "dense": RANDOM_BIAS,
            "output_gate": RANDOM_BIAS,  # split like the query heads (here the heads of the one group)
            "window_size": 3,
            "key_norm": RANDOM_NORM,
            "rotary": {"type": "llama3", "theta": 100.0, "original_context_length": 64},
        },
    },
    4: {
        "groups-split": {"heads": 8, "head_groups": 4, "head_size": 4, "query_norm": RANDOM_NORM},
        "fewer-groups-than-ranks": {"heads": 8, "head_groups": 2, "head_size": 4, **BIASES, "key_norm": RANDOM_NORM},
        "mqa": {"heads": 4, "head_groups": 1, "head_size": 8, **BIASES, "query_norm": RANDOM_NORM, "window_size": 2},
    },
}
REFUSED = {
    2: [],
    4: [
        (
            {"heads": 4, "head_groups": 2, "head_size": 8},
            r"\(type .attention.\): head_groups: tensor_parallel=4 must divide head_groups \(2\) or the heads per",
        )
    ],
}


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_matches_single_process(world_size):
    # 12 tokens: sequence-tensor-parallel splits them between 2 or 4 ranks.
    check_tensor_parallel(
        AttentionConfig,
        CASES[world_size],
        lengths=[5, 3, 4],
        tensor_parallel=world_size,
        seed=SEED,
        refused=REFUSED[world_size],
    )
