"""blockzoo's conformance kit on the Mamba 2 mixer's converter sections, one per Hugging Face format (mamba2, bamba,
nemotron_h): registered without torch, every architecture field claimed, config and weights both ways bit for bit,
every key written claimed; Falcon-H1's output-norm variants (no norm, normalize then gate) and the other formats
refusing them by name. The formats themselves (against transformers) are blockzoo-huggingface's tests."""

import math

import pytest

from blockzoo.config import structure
from blockzoo.conversion import ConversionError, export_config
from blockzoo_mamba_2.config import Mamba2Config
from blockzoo_mamba_2.huggingface import transformers_norm_is_per_group
from blockzoo_testing import ConverterSectionConformance

# Two groups (where the formats' norms differ), biases on in_proj and out_proj, none on the convolution.
_MIXER = {
    "type": "mamba_2",
    "heads": 4,
    "head_size": 4,
    "groups": 2,
    "state_size": 4,
    "chunk_size": 8,
    "convolution": {"kernel_size": 3, "bias": {"enabled": False}},
    "add_linear_biases": True,
}
# How transformers' Mamba2 and Bamba normalize: over the whole inner dimension up to 5.22, per group since 5.23.
_HF_PER_GROUP = transformers_norm_is_per_group(None)


class TestMamba2Mamba2SectionConformance(ConverterSectionConformance):
    kind, format_name = "mixer", "mamba2"

    def config_factory(self):
        return {**_MIXER, "dt_limit": [0.01, 5.0], "normalization": {"per_group": _HF_PER_GROUP, "epsilon": 1.0e-4}}


class TestMamba2BambaSectionConformance(ConverterSectionConformance):
    kind, format_name = "mixer", "bamba"

    def config_factory(self):
        return {**_MIXER, "dt_limit": [0.0, math.inf], "normalization": {"per_group": _HF_PER_GROUP, "epsilon": 1.0e-4}}


class TestMamba2NemotronHSectionConformance(ConverterSectionConformance):
    kind, format_name = "mixer", "nemotron_h"

    def config_factory(self):
        # NemotronH clamps the time step to [time_step_min, inf) and normalizes per group.
        return {**_MIXER, "dt_limit": [0.2, math.inf], "normalization": {"per_group": True, "epsilon": 1.0e-4}}


class TestMamba2FalconH1SectionConformance(ConverterSectionConformance):
    kind, format_name = "mixer", "falcon_h1"

    def config_factory(self):
        # Falcon-H1: per-group norm, in_proj's bias without out_proj's (two keys), the ssm_multipliers.
        return {
            **_MIXER,
            "out_proj": {"bias": {"enabled": False}},
            "dt_limit": [0.1, 4.0],
            "normalization": {"per_group": True, "epsilon": 1.0e-4},
            "in_proj_multipliers": {"z": 0.5, "x": 1.5, "b": 0.7, "c": 1.1, "dt": 0.9},
        }


class TestMamba2FalconH1NoNormSectionConformance(ConverterSectionConformance):
    kind, format_name = "mixer", "falcon_h1"

    def config_factory(self):
        # `mamba_rms_norm` false: no norm, so no `norm.weight` among the weights.
        return {**_MIXER, "out_proj": {"bias": {"enabled": False}}, "normalization": {"enabled": False}}


class TestMamba2FalconH1NormBeforeGateSectionConformance(ConverterSectionConformance):
    kind, format_name = "mixer", "falcon_h1"

    def config_factory(self):
        return {
            **_MIXER,
            "out_proj": {"bias": {"enabled": False}},
            "normalization": {"norm_before_gate": True, "epsilon": 1.0e-4},
        }


def test_falcon_h1_writes_the_norm_variants():
    def keys(normalization: dict) -> tuple:
        config = structure({**_MIXER, "normalization": normalization}, Mamba2Config)
        exported = export_config("falcon_h1", config, path="mixer")
        return exported["mamba_rms_norm"], exported["mamba_norm_before_gate"]

    assert keys({}) == (True, False)
    assert keys({"norm_before_gate": True}) == (True, True)
    # Without the norm, the order is written as transformers' default (it reads it only with the norm).
    assert keys({"enabled": False}) == (False, True)


# transformers' Mamba2, Bamba (Granite-4.0 hybrid's layers) and NemotronH always gate, then normalize.
@pytest.mark.parametrize("format_name", ["mamba2", "bamba", "nemotron_h", "granitemoehybrid"])
@pytest.mark.parametrize(
    ("normalization", "field"),
    [({"enabled": False}, "normalization.enabled"), ({"norm_before_gate": True}, "normalization.norm_before_gate")],
)
def test_formats_with_one_norm_refuse_the_variants_by_name(format_name, normalization, field):
    per_group = True if format_name == "nemotron_h" else _HF_PER_GROUP
    config = structure({**_MIXER, "normalization": {"per_group": per_group, **normalization}}, Mamba2Config)
    export_config(format_name, structure({**_MIXER, "normalization": {"per_group": per_group}}, Mamba2Config))
    with pytest.raises(ConversionError, match=rf"`{field}` = (True|False) cannot be written: the format has only"):
        export_config(format_name, config, path="mixer")
