"""Tensor parallel and sequence-data parallel against one process: `check_tensor_parallel` and
`check_sequence_data_parallel`, for the conformance kit and plugins' own tests.

One set of gloo ranks runs every case. Each rank builds the single-process reference itself from the same seed, then
the layer split between the ranks (and, where the type declares sequence_tensor_parallel, split with each rank
holding a slice of the tokens): the outputs, the input gradient, every parameter's shards and gradient assembled to
the global tensor and the FLOPs must be those of one process; a mixer that declares generation_cache must decode,
split, as one process runs its full forward.

`check_sequence_data_parallel` splits the tokens of a packed batch into consecutive slices over gloo ranks (and,
optionally, each rank's share into micro-sequence chunks): each rank's outputs and input gradient are the single
process's for its tokens, the parameter gradients summed over the ranks and the named losses are the single
process's.
"""

from blockzoo_testing.parallel.jobs import DEFAULT_LENGTHS, DEFAULT_TOLERANCE
from blockzoo_testing.parallel.sequence_data import (
    DEFAULT_MICRO_SEQUENCE_LENGTHS,
    DEFAULT_SEQUENCE_DATA_SIZES,
    check_sequence_data_parallel,
    sequence_data_gradient_tolerance,
)
from blockzoo_testing.parallel.tensor import check_tensor_parallel

__all__ = [
    "DEFAULT_LENGTHS",
    "DEFAULT_MICRO_SEQUENCE_LENGTHS",
    "DEFAULT_SEQUENCE_DATA_SIZES",
    "DEFAULT_TOLERANCE",
    "check_sequence_data_parallel",
    "check_tensor_parallel",
    "sequence_data_gradient_tolerance",
]
