"""The discrete Mamba 2 mixer's Hugging Face converter section (Apriel's "m2d" layers) through blockzoo's
conformance kit: every field claimed, config and weights both ways bit for bit, torch-free; with in_proj biases and
without (then `z_bias`)."""

from blockzoo_testing import ConverterSectionConformance


class TestAprielDiscreteMamba2SectionConformance(ConverterSectionConformance):
    kind, format_name = "mixer", "apriel_hybrid_ssm"

    def config_factory(self):
        return {
            "type": "discrete_mamba_2",
            "heads": 4,
            "groups": 2,
            "head_size": 4,
            "state_size": 4,
            "chunk_size": 8,
            "activation": "silu",
            "convolution": {"kernel_size": 3, "bias": {"enabled": False}},
        }


class TestAprielDiscreteMamba2WithBiasesSectionConformance(ConverterSectionConformance):
    kind, format_name = "mixer", "apriel_hybrid_ssm"

    def config_factory(self):
        return {"type": "discrete_mamba_2", "heads": 4, "head_size": 4, "state_size": 4, "add_linear_biases": True}
