"""blockzoo's conformance kit (`blockzoo.testing`) on the Gated DeltaNet mixer: discovery, config, shapes,
meta-device construction, packed documents, every field, gradients, tensor and sequence-tensor parallel, decoding,
checkpoints and FLOPs, as any plugin's mixer is checked."""

from blockzoo_testing import MixerConformance


class TestGatedDeltaNetConformance(MixerConformance):
    field_exceptions = {"chunk_size": "splits the delta rule into chunks: speed and memory, not the result"}

    def config_factory(self):
        # Two key heads each read by two value heads; chunks shorter than the documents of the test batch.
        return {
            "type": "gated_delta_net",
            "key_heads": 2,
            "value_heads": 4,
            "key_head_size": 4,
            "value_head_size": 3,
            "chunk_size": 4,
        }
