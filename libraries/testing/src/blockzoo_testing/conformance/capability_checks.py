"""The checks of the capabilities a layer declares: tensor parallelism, slices and sequence-data parallelism,
generation."""

from __future__ import annotations

import pytest

from blockzoo.layers.config import GENERATION_CACHE, SEQUENCE_DATA_PARALLEL, TENSOR_PARALLEL
from blockzoo_testing.conformance.base import ConformanceBase
from blockzoo_testing.decoding import check_decoding
from blockzoo_testing.layers import check_forward_slices
from blockzoo_testing.parallel import check_sequence_data_parallel, check_tensor_parallel


class CapabilityChecks(ConformanceBase):
    """The conformance kit's checks of the capabilities a layer declares."""

    # -- declared capabilities ---------------------------------------------------------------------------------------

    @pytest.mark.distributed
    def test_tensor_parallel_matches_one_process(self) -> None:
        config = self._config()
        if TENSOR_PARALLEL not in config.capabilities:
            pytest.skip(f"{type(config).__name__} does not declare tensor_parallel")
        for size in self.tensor_parallel_sizes:
            check_tensor_parallel(
                self.kind_config,
                {"config_factory()": config},
                hidden_size=self.hidden_size,
                lengths=self.lengths,
                tolerance=self.tolerance,
                tensor_parallel=size,
                seed=self.seed,
            )

    def test_forward_slices_equal_the_whole_forward(self) -> None:
        config = self._config()
        if SEQUENCE_DATA_PARALLEL not in config.capabilities:
            pytest.skip(f"{type(config).__name__} does not declare sequence_data_parallel")
        layer = self._build(config)
        for length in self.slice_lengths:
            check_forward_slices(layer, lengths=self.lengths, slice_length=length, tolerance=self.tolerance)

    @pytest.mark.distributed
    def test_sequence_data_parallel_matches_one_process(self) -> None:
        config = self._config()
        if SEQUENCE_DATA_PARALLEL not in config.capabilities:
            pytest.skip(f"{type(config).__name__} does not declare sequence_data_parallel")
        # Not `lengths`: generated batches whose every slice continues a document (blockzoo_testing.layouts), all
        # sizes in one set of processes.
        check_sequence_data_parallel(
            self.kind_config,
            {"config_factory()": config},
            hidden_size=self.hidden_size,
            tolerance=self.tolerance,
            sequence_data_parallel=self.sequence_data_parallel_sizes,
            micro_sequence_lengths=self.micro_sequence_lengths,
            seed=self.seed,
        )

    def test_generation_equals_the_full_forward(self) -> None:
        config = self._config()
        if GENERATION_CACHE not in config.capabilities:
            pytest.skip(f"{type(config).__name__} does not declare generation_cache")
        check_decoding(self._build(config), tolerance=self.tolerance)
