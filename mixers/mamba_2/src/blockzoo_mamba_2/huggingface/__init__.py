"""How the Mamba 2 mixer is written in the Hugging Face formats (converter sections, see `blockzoo.conversion`).

`mamba2` (Mamba2ForCausalLM, module `mixer`), `bamba` (module `mamba`, keys `mamba_*`; Granite's the same),
`nemotron_h` (module `mixer`) and `falcon_h1` (Bamba's keys, `mamba_d_ssm`, two bias keys, `ssm_multipliers`). The
parameters map one to one: in_proj's rows are z, x, B, C, dt in both, heads group-major; only the convolution's
weight changes shape ([C, K] here, Conv1d's [C, 1, K] there). What differs between the formats is the names of the
keys and the gated norm: per group in NemotronH; in Mamba2 and Bamba over the whole inner dimension up to
transformers 5.22 and per group since 5.23 (the same when there is one group), so those follow the transformers that
wrote the config.json on import, and the installed one on export. Only Falcon-H1 has the norm's variants
(`mamba_rms_norm`, `mamba_norm_before_gate`); the other formats always gate, then normalize, and refuse to write a
model without its norm or normalizing first. The inner size (`expand`, read with the hidden size) is the converter's.
Torch-free.

The package: `transformers_releases` (config.json floats, transformers release checks), `section` (the section every
format builds on, `mamba_2_section`), `formats` (each format's section, `SECTIONS`); `register_sections` is here.
"""

from __future__ import annotations

from collections.abc import Callable

from blockzoo.api import Section
from blockzoo_mamba_2.huggingface.formats import (
    FALCON_H1_BIASES,
    FALCON_H1_EPSILON,
    FALCON_H1_IN_PROJ_MULTIPLIERS,
    FALCON_H1_NORM,
    INITIALIZATION_ONLY,
    MAMBA_PREFIXED_KEYS,
    NEMOTRON_TIME_STEP,
    NEMOTRON_UNREAD,
    SECTIONS,
)
from blockzoo_mamba_2.huggingface.section import GATE_THEN_NORM, NO_IN_PROJ_MULTIPLIERS, mamba_2_section
from blockzoo_mamba_2.huggingface.transformers_releases import (
    read_float,
    transformers_norm_is_per_group,
    transformers_release_at_least,
    write_float,
)

__all__ = [
    "FALCON_H1_BIASES",
    "FALCON_H1_EPSILON",
    "FALCON_H1_IN_PROJ_MULTIPLIERS",
    "FALCON_H1_NORM",
    "GATE_THEN_NORM",
    "INITIALIZATION_ONLY",
    "MAMBA_PREFIXED_KEYS",
    "NEMOTRON_TIME_STEP",
    "NEMOTRON_UNREAD",
    "NO_IN_PROJ_MULTIPLIERS",
    "SECTIONS",
    "mamba_2_section",
    "read_float",
    "register_sections",
    "transformers_norm_is_per_group",
    "transformers_release_at_least",
    "write_float",
]


def register_sections(register: Callable[[str, Section], None]) -> None:
    """The Mamba 2 section of every Hugging Face format with Mamba 2 layers."""
    for format_name, section in SECTIONS.items():
        register(format_name, section)
