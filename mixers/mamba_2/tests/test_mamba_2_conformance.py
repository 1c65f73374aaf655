"""blockzoo's conformance kit (`blockzoo_testing`) on the Mamba 2 mixer: discovery, config, shapes, meta-device
construction, packed documents, every field, gradients, tensor and sequence-tensor parallel, decoding, checkpoints
and FLOPs, as any plugin's mixer is checked."""

from blockzoo_testing import MixerConformance


class TestMamba2Conformance(MixerConformance):
    # dt_limit clamps the time step; the default (0, inf) clamps nothing, this one clamps the initial dt_bias range.
    field_changes = {
        "dt_limit": {"dt_limit": [0.01, 0.05]},
        "in_proj_multipliers": {"in_proj_multipliers": {"x": 2.0}},
    }
    field_exceptions = {
        "chunk_size": "splits the scan into chunks: speed and memory, not the result",
        "recompute_convolution": "what the backward pass keeps on the GPU kernels: memory, not the result",
    }

    def config_factory(self):
        # Two groups of B/C shared by two heads each; chunks shorter than the documents of the test batch.
        return {"type": "mamba_2", "heads": 4, "head_size": 4, "groups": 2, "state_size": 4, "chunk_size": 4}
