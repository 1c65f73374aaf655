"""The three Mamba mixers under sequence-data parallelism, on gloo: each rank's outputs and input gradient are the
single process's for its tokens, and the parameter gradients summed over the ranks are the single process's
(`blockzoo_testing.check_sequence_data_parallel`), over 2 and 4 ranks, one slice a rank and in micro-sequence chunks
(the state and the convolution's inputs carried from chunk to chunk as well as between ranks). One spawn per
world size runs every case of all three mixers.

The 24 tokens: documents of 7, 1, 3, 9, 1 and 3 tokens. Over 4 ranks (slices of 6) documents straddle two
boundaries, the slice [12, 18) lies inside one document (the state is carried through it, decayed), and a one-token
document sits inside a slice; micro-sequences of 2 put boundaries on document boundaries (8, 20) and make slices
shorter than the convolution's kernel_size - 1 (its halo reaches back over two ranks or into the previous step).
Over 2 ranks (slices of 12) the boundary cuts the 9-token document; micro-sequences of 3 end one chunk on the
boundary at 21.
"""

import pytest

from blockzoo.config import structure
from blockzoo_discrete_mamba_2.config import DiscreteMamba2Config
from blockzoo_mamba.config import MambaConfig
from blockzoo_mamba_2.config import Mamba2Config
from blockzoo_testing import check_sequence_data_parallel

LENGTHS = (7, 1, 3, 9, 1, 3)
# Time steps around 0.1-3 (softplus of N(0, 1)): the state decays visibly within a slice.
LARGE_DT = {"dt_bias": {"initialization": {"type": "normal", "std": 1.0}}}
RANDOM = {"initialization": {"type": "normal", "std": 0.5}}
CASES = {
    "mamba-standard": (MambaConfig, {"state_size": 4, "convolution": {"kernel_size": 4, "bias": RANDOM}}),
    "mamba-grouped-repeat-before": (
        MambaConfig,
        {"state_size": 4, "inner_size": 32, "xb_size": 16, "dt_rank": 2, "d": RANDOM, **LARGE_DT},
    ),
    "mamba-grouped-repeat-after": (
        MambaConfig,
        {
            "state_size": 4,
            "inner_size": 24,
            "xb_size": 8,
            "repeat_xb_before_convolution": False,
            "convolution": {"kernel_size": 2, "bias": {"enabled": False}},
        },
    ),
    "mamba_2-groups-dt-limit": (
        Mamba2Config,
        {"heads": 4, "head_size": 4, "state_size": 3, "chunk_size": 4, "groups": 2, "dt_limit": [0.2, 2.0], **LARGE_DT},
    ),
    "mamba_2-kernel-size-one-per-channel-d": (
        Mamba2Config,
        {"heads": 4, "head_size": 2, "state_size": 3, "chunk_size": 256, "convolution": {"kernel_size": 1}}
        | {"d_per_channel": True, **LARGE_DT},
    ),
    "discrete_mamba_2-identity": (
        DiscreteMamba2Config,
        {"heads": 4, "groups": 2, "head_size": 3, "state_size": 5, "chunk_size": 4},
    ),
    "discrete_mamba_2-silu-kernel-3": (
        DiscreteMamba2Config,
        {"heads": 4, "groups": 1, "head_size": 3, "state_size": 5, "chunk_size": 3, "activation": "silu"}
        | {"convolution": {"kernel_size": 3}, "d": RANDOM},
    ),
}


@pytest.mark.distributed
@pytest.mark.parametrize(("size", "micro_sequence_length"), [(2, 3), (4, 2)])
def test_every_mamba_mixer_matches_one_process(size, micro_sequence_length):
    cases = {name: structure(data, config_class) for name, (config_class, data) in CASES.items()}
    check_sequence_data_parallel(
        MambaConfig,  # the cases are configs already: each is built by its own type
        cases,
        lengths=LENGTHS,
        sequence_data_parallel=size,
        micro_sequence_lengths=(None, micro_sequence_length),
    )
