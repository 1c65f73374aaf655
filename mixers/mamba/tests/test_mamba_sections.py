"""The Mamba 1 mixer's Hugging Face converter sections through blockzoo's conformance kit: every field claimed,
config and weights both ways bit for bit, torch-free. `mamba` (MambaForCausalLM) in the standard layout, Apriel's
"m2" layers in the grouped one; Jamba's, whose dt/B/C norms need the normalization sections of
blockzoo-huggingface, is checked in converters/huggingface/tests/test_sections_mamba.py."""

from blockzoo_testing import ConverterSectionConformance


class TestMambaSectionConformance(ConverterSectionConformance):
    kind, format_name = "mixer", "mamba"

    def config_factory(self):
        return {
            "type": "mamba",
            "state_size": 4,
            "expand": 3,
            "dt_rank": 3,
            "convolution": {"kernel_size": 3, "bias": {"enabled": False}},
            "add_linear_biases": True,
            "dt_init": "constant",
            "dt_scale": 0.5,
            "dt_bias": {"initialization": {"type": "dt_bias", "min": 0.002, "max": 0.2, "floor": 2e-4}},
        }


class TestAprielMambaSectionConformance(ConverterSectionConformance):
    kind, format_name = "mixer", "apriel_hybrid_ssm"

    def config_factory(self):
        # Two x/B heads of state_size channels, each shared by four C heads; the convolution after the repeat.
        return {
            "type": "mamba",
            "state_size": 4,
            "inner_size": 32,
            "xb_size": 8,
            "repeat_xb_before_convolution": False,
            "dt_rank": 3,
            "add_linear_biases": True,
            "dt_scale": 2.0,
        }
