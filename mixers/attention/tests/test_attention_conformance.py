"""blockzoo's conformance kit (`blockzoo_testing`) on the attention mixer: discovery, config, shapes, packed
documents, every field, gradients, tensor and sequence-tensor parallel, KV-cache decoding, checkpoints, FLOPs; and
its Llama converter section (config and weights both ways, everything claimed; the sections with head norms need
the normalization sections of blockzoo-huggingface, whose tests cover them)."""

from blockzoo_testing import ConverterSectionConformance, MixerConformance


class TestAttentionConformance(MixerConformance):
    field_changes = {
        # The base has a sliding window, which needs causal attention: drop it with the change.
        "causal": {"causal": False, "window_size": None},
    }
    field_exceptions = {"implementation": "picks the kernel; every kernel computes the same attention"}

    def config_factory(self):
        # GQA split by groups under tensor-parallel, biases (key‖value replicated rows), a per-head norm whose
        # gradient is partial per rank, a window and a non-default rotary.
        return {
            "type": "attention",
            "heads": 4,
            "head_groups": 2,
            "head_size": 8,
            "window_size": 4,
            "add_linear_biases": True,
            "dense": {"bias": {"enabled": False}},
            "key_norm": {"type": "rms_norm"},
            "rotary": {"type": "default", "theta": 100.0},
        }


class TestAttentionLlamaSectionConformance(ConverterSectionConformance):
    kind, format_name = "mixer", "llama"

    def config_factory(self):
        return {
            "type": "attention",
            "heads": 4,
            "head_groups": 2,
            "head_size": 8,
            "add_linear_biases": True,
            "rotary": {"type": "llama3", "theta": 500000.0, "scale_factor": 8.0},
        }
