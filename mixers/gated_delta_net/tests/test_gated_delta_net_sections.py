"""blockzoo's conformance kit on the Gated DeltaNet mixer's converter section (format qwen3_next): registered
without torch, every architecture field claimed, config and weights both ways bit for bit, every key written
claimed. The format itself (against transformers) is blockzoo-huggingface's tests; the mixer against transformers'
own layer is test_gated_delta_net_transformers.py."""

from blockzoo_testing import ConverterSectionConformance


class TestGatedDeltaNetQwen3NextSectionConformance(ConverterSectionConformance):
    kind, format_name = "mixer", "qwen3_next"

    def config_factory(self):
        # Grouped values (the regrouping of in_proj_qkvz and in_proj_ba), sizes differing from the defaults.
        return {
            "type": "gated_delta_net",
            "key_heads": 2,
            "value_heads": 6,
            "key_head_size": 4,
            "value_head_size": 3,
            "convolution": {"kernel_size": 3},
            "normalization": {"epsilon": 1.0e-4},
        }
