"""blockzoo's conformance kit (`blockzoo_testing`) on the MLA mixer: discovery, config, shapes, meta-device
construction, packed documents, every field, gradients, tensor and sequence-tensor parallel (with tensor-parallel
decoding), decoding, checkpoints, FLOPs; and its deepseek_v3 converter section (config and weights both ways,
everything claimed)."""

from blockzoo_testing import ConverterSectionConformance, MixerConformance


class TestMLAConformance(MixerConformance):
    field_exceptions = {
        "implementation": "picks the kernel; every kernel computes the same attention",
        "absorbed_decoding": "picks the decoding form; test_mla.py checks both against each other and the full forward",
        "query": "the projection without query_rank (the base has a low-rank query); test_mla.py's plain-query case",
    }

    def config_factory(self):
        # A low-rank query with biases (replicated down projections, column-parallel ups), distinct head sizes,
        # norms with random weights (replicated parameters of the residual stream under sequence-tensor parallel).
        norm = {"weight": {"initialization": {"type": "normal", "mean": 1.0, "std": 0.3}}}
        return {
            "type": "mla",
            "heads": 4,
            "query_rank": 12,
            "key_value_rank": 8,
            "nope_head_size": 6,
            "rotary_head_size": 4,
            "value_head_size": 5,
            "add_linear_biases": True,
            "dense": {"bias": {"enabled": False}},
            "query_norm": norm,
            "key_value_norm": norm,
            "rotary": {"type": "default", "theta": 100.0},
        }


class TestMLADeepseekV3SectionConformance(ConverterSectionConformance):
    kind, format_name = "mixer", "deepseek_v3"

    def config_factory(self):
        return {
            "type": "mla",
            "heads": 4,
            "query_rank": 12,
            "key_value_rank": 8,
            "nope_head_size": 6,
            "rotary_head_size": 4,
            "value_head_size": 5,
            "add_linear_biases": True,
            "query": {"bias": {"enabled": False}},
            "query_up": {"bias": {"enabled": False}},
            "key_value_up": {"bias": {"enabled": False}},
            "query_norm": {"epsilon": 1.0e-6},
            "key_value_norm": {"epsilon": 1.0e-6},
            "interleaved_rotary": True,
            "rotary": {"type": "default", "theta": 500.0},
        }
