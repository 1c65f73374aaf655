"""A plugin's GPU tests: its layer on CUDA against the same config on the CPU path (run them on a GPU machine).

`CudaComparison` holds what a mixer's GPU tests share (how to build the layer, its seed, its tolerances by dtype) and
runs the kit's checks with the layer on CUDA (an `nccl` single process):

    CUDA = CudaComparison(functools.partial(build, hidden=64), seed=SEED, output_tolerance=OUTPUT_TOLERANCE,
                          gradient_tolerance=GRADIENT_TOLERANCE)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_cuda_matches_the_cpu_path(dtype):
        CUDA.check_matches_cpu({"heads": 4}, dtype)

The default documents, `CUDA_LENGTHS`, are 256 tokens in lengths that are multiples of no block or chunk size, one of
a single token; `CUDA_DECODING` is a prefill of prompts of different lengths, a chunk, then one token at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.base import Layer
from blockzoo_testing.layers import (
    check_decoding,
    check_forward_slices,
    check_matches_layer,
    check_padded_batch,
    single_process,
)

CUDA_LENGTHS = (37, 1, 90, 128)
CUDA_DECODING = {"lengths": (40, 29), "steps": ((36, 20), (2, 7), (1, 1), (1, 1))}
# A padded batch runs the same kernels on the same tokens: only bf16 rounding of other reduction orders differs.
PADDED_TOLERANCE = {"relative": 1e-2}


@attrs.frozen
class CudaComparison:
    """What a layer's GPU tests share.

    - `build(config, distributed)`: the layer of `config` on `distributed`; with None, the CPU reference (one gloo
      process seeded as the tests want);
    - `seed`: the seed of the CUDA layer's process (the same as the reference's, so that both have one set of
      parameters);
    - `output_tolerance` / `gradient_tolerance`: dtype -> tolerance of `check_matches_layer`
      (`{"relative": 1e-3}`: ‖x − reference‖ / ‖reference‖);
    - `lengths`: the documents of the packed batch.
    """

    build: Callable[[Any, Distributed | None], Layer]
    seed: int
    output_tolerance: Mapping[torch.dtype, Mapping[str, float]]
    gradient_tolerance: Mapping[torch.dtype, Mapping[str, float]]
    lengths: Sequence[int] = CUDA_LENGTHS

    def cuda_layer(self, config: Any, **options: Any) -> Layer:
        """The layer of `config` on CUDA; `options` go to the process's distributed config (e.g. compute_dtype)."""
        return self.build(config, single_process(self.seed, backend="nccl", **options))

    def check_matches_cpu(
        self, config: Any, dtype: torch.dtype, *, cpu_config: Any = None, lengths: Sequence[int] | None = None
    ) -> None:
        """The layer of `config` on CUDA fed `dtype` against the CPU layer of `cpu_config` (default: `config`) in
        fp32: outputs and every gradient (`check_matches_layer`)."""
        check_matches_layer(
            self.cuda_layer(config),
            self.build(config if cpu_config is None else cpu_config, None),
            lengths=self.lengths if lengths is None else lengths,
            dtype=dtype,
            output_tolerance=self.output_tolerance[dtype],
            gradient_tolerance=self.gradient_tolerance[dtype],
        )

    def check_slices(
        self,
        config: Any,
        slice_lengths: Sequence[int],
        tolerance: Mapping[str, float],
        *,
        dtype: torch.dtype = torch.float32,
        **options: Any,
    ) -> None:
        """On CUDA, consecutive slices of each of `slice_lengths` against the whole forward (`check_forward_slices`);
        `options` as in `cuda_layer`."""
        layer = self.cuda_layer(config, **options)
        for slice_length in slice_lengths:
            check_forward_slices(
                layer, lengths=self.lengths, slice_length=slice_length, tolerance=tolerance, dtype=dtype
            )

    def check_decoding(self, config: Any, dtype: torch.dtype = torch.float32) -> None:
        """On CUDA, generation (`CUDA_DECODING`) against the full forward, within the output tolerance of `dtype`."""
        check_decoding(self.cuda_layer(config), tolerance=self.output_tolerance[dtype], dtype=dtype, **CUDA_DECODING)

    def check_padded_batch(self, config: Any) -> None:
        """What `training.cuda_graphs` runs, in bf16 on CUDA: empty documents first and a length bound, against the
        exact batch (`check_padded_batch`)."""
        layer = self.cuda_layer(config)
        check_padded_batch(layer, lengths=self.lengths, dtype=torch.bfloat16, tolerance=PADDED_TOLERANCE)
