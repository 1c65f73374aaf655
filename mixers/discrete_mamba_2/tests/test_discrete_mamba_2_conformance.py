"""blockzoo's conformance kit on the mixer: discovery, config round trips, meta-device construction, bf16, packed
documents, tensor parallel, decoding, checkpoints and FLOPs, as any plugin's mixer is checked."""

from blockzoo_testing import MixerConformance


class TestDiscreteMamba2Conformance(MixerConformance):
    field_exceptions = {"chunk_size": "splits the scan into chunks: speed and memory, not the result"}

    def config_factory(self):
        return {
            "type": "discrete_mamba_2",
            "heads": 4,
            "groups": 2,
            "head_size": 3,
            "state_size": 5,
            "chunk_size": 4,
            "z_bias": {"initialization": {"type": "normal", "std": 0.5}},
        }
