"""The Mamba 2 section of each Hugging Face format (`SECTIONS`): the keys and the mappings of Mamba2, Bamba (and
Granite's hybrid), NemotronH and Falcon-H1. Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from blockzoo.api import Computed, ConversionError, Ignored, Section
from blockzoo_mamba_2.config import IN_PROJ_COMPONENTS, Mamba2Config
from blockzoo_mamba_2.huggingface.section import _BIAS_FIELDS, _time_step_limit, mamba_2_section
from blockzoo_mamba_2.huggingface.transformers_releases import transformers_release_at_least


def _nemotron_time_step_min(data: Mapping[str, Any]) -> dict[str, Any]:
    return {"dt_limit": (float(data.get("time_step_min", 1e-3)), math.inf)}


def _nemotron_write_time_step_min(config: Mamba2Config) -> dict[str, Any]:
    low, high = config.dt_limit
    if high != math.inf:
        raise ConversionError(
            f"`dt_limit` = {list(config.dt_limit)} cannot be written: NemotronH (the installed transformers, before "
            "5.25) clamps the time step to [time_step_min, inf), with no upper limit"
        )
    return {"time_step_min": low}


INITIALIZATION_ONLY = "they set the initialization of dt_bias, not what the model computes"


# How transformers' NemotronH clamps the time step: to `time_step_limit` since 5.25 (its config also takes it as
# `mamba_dt_limit`), `time_step_min` being only where dt's initialization starts; to [time_step_min, inf) before,
# `time_step_limit` unread. Read and written as the installed transformers runs it.
_NEMOTRON_LIMIT_SINCE = (5, 25)
if transformers_release_at_least(_NEMOTRON_LIMIT_SINCE):
    NEMOTRON_TIME_STEP = _time_step_limit("time_step_limit")
    NEMOTRON_UNREAD = Ignored(theirs=("time_step_min",), reason=INITIALIZATION_ONLY)
else:
    NEMOTRON_TIME_STEP = Computed(
        ("dt_limit",), ("time_step_min",), import_=_nemotron_time_step_min, export=_nemotron_write_time_step_min
    )
    NEMOTRON_UNREAD = Ignored(theirs=("time_step_limit",), reason="NemotronH before transformers 5.25 does not read it")


def _bamba_head_size(data: Mapping[str, Any]) -> dict[str, Any]:
    head_size = data.get("mamba_d_head", "auto")
    if head_size == "auto":  # as transformers: the inner size split between the heads
        head_size = int(data.get("mamba_expand", 2) * data["hidden_size"]) // data["mamba_n_heads"]
    return {"head_size": head_size}


# The keys of the hybrids that prefix their Mamba 2 settings with `mamba_` (Bamba, GraniteMoeHybrid, Falcon-H1).
MAMBA_PREFIXED_KEYS = {
    "heads": "mamba_n_heads",
    "groups": "mamba_n_groups",
    "state_size": "mamba_d_state",
    "kernel_size": "mamba_d_conv",
    "chunk_size": "mamba_chunk_size",
    "bias": "mamba_proj_bias",
    "convolution_bias": "mamba_conv_bias",
    "epsilon": "rms_norm_eps",
    # Also the MLPs' activation: a hybrid with Mamba layers has silu MLPs.
    "activation": "hidden_act",
}

SECTIONS: dict[str, Section] = {
    "mamba2": mamba_2_section(
        name="mixer",
        keys={
            "heads": "num_heads",
            "head_size": "head_dim",
            "groups": "n_groups",
            "state_size": "state_size",
            "kernel_size": "conv_kernel",
            "chunk_size": "chunk_size",
            "bias": "use_bias",
            "convolution_bias": "use_conv_bias",
            "epsilon": "layer_norm_epsilon",
            "activation": "hidden_act",
        },
        per_group=None,
        time_step=_time_step_limit("time_step_limit"),
        extra=(
            Ignored(theirs=("time_step_min", "time_step_max", "time_step_floor"), reason=INITIALIZATION_ONLY),
            Ignored(theirs=("time_step_rank",), reason="a Mamba 1 key transformers' Mamba 2 does not use"),
        ),
    ),
    "bamba": mamba_2_section(
        name="mamba",
        keys=MAMBA_PREFIXED_KEYS,
        per_group=None,
        time_step=_time_step_limit("time_step_limit"),
        head_size=Computed(
            ("head_size",),
            ("mamba_d_head",),
            import_=_bamba_head_size,
            export=lambda config: {"mamba_d_head": config.head_size},
        ),
    ),
    "nemotron_h": mamba_2_section(
        name="mixer",
        keys={
            "heads": "mamba_num_heads",
            "head_size": "mamba_head_dim",
            "groups": "n_groups",
            "state_size": "ssm_state_size",
            "kernel_size": "conv_kernel",
            "chunk_size": "chunk_size",
            "bias": "use_bias",
            "convolution_bias": "use_conv_bias",
            "epsilon": "layer_norm_epsilon",
            "activation": "mamba_hidden_act",
        },
        per_group=True,
        time_step=NEMOTRON_TIME_STEP,
        extra=(
            Ignored(theirs=("time_step_max", "time_step_floor"), reason=INITIALIZATION_ONLY),
            NEMOTRON_UNREAD,
            Ignored(
                theirs=("mamba_proj_bias", "expand"),
                reason="transformers' NemotronH does not read them (the inner size is heads · head_dim, the "
                "projections' bias is `use_bias`)",
            ),
            Ignored(theirs=("mamba_ssm_cache_dtype",), reason="the dtype of transformers' generation cache"),
        ),
    ),
}


def _falcon_head_size(data: Mapping[str, Any]) -> dict[str, Any]:
    # As transformers: the inner size is `mamba_d_ssm`, or `mamba_expand` · hidden when null; "auto" splits it.
    inner = data.get("mamba_d_ssm")
    if inner is None:
        inner = int(data.get("mamba_expand", 2) * data["hidden_size"])
    head_size = data.get("mamba_d_head", "auto")
    if head_size == "auto":
        head_size = inner // data["mamba_n_heads"]
    if head_size * data["mamba_n_heads"] != inner:
        raise ConversionError(
            f"`mamba_n_heads` {data['mamba_n_heads']} × `mamba_d_head` {head_size} is not the inner size {inner} "
            "(`mamba_d_ssm`, or `mamba_expand` × `hidden_size`)"
        )
    return {"head_size": head_size}


def _import_falcon_biases(data: Mapping[str, Any]) -> dict[str, Any]:
    # in_proj's bias is `mamba_proj_bias`, out_proj's `projectors_bias` (set only where the two differ).
    in_proj, out_proj = bool(data.get("mamba_proj_bias", False)), bool(data.get("projectors_bias", False))
    return {"add_linear_biases": in_proj, "out_proj.bias.enabled": None if out_proj == in_proj else out_proj}


FALCON_H1_BIASES = Computed(
    _BIAS_FIELDS,
    ("mamba_proj_bias", "projectors_bias"),
    import_=_import_falcon_biases,
    export=lambda config: {
        "mamba_proj_bias": config.has_bias(config.z),
        "projectors_bias": config.has_bias(config.out_proj),
    },
)


def _import_falcon_multipliers(data: Mapping[str, Any]) -> dict[str, Any]:
    multipliers = data.get("ssm_multipliers") or [1.0] * len(IN_PROJ_COMPONENTS)
    if not isinstance(multipliers, (list, tuple)) or len(multipliers) != len(IN_PROJ_COMPONENTS):
        raise ConversionError(f"`ssm_multipliers` must be [z, x, B, C, dt], got {multipliers!r}")
    return {
        "in_proj_multipliers": {
            name: float(value) for name, value in zip(IN_PROJ_COMPONENTS, multipliers) if value != 1
        }
    }


# Falcon-H1's `ssm_multipliers` (its mup_vector): in_proj's output z, x, B, C, dt each times its multiplier.
FALCON_H1_IN_PROJ_MULTIPLIERS = Computed(
    ("in_proj_multipliers",),
    ("ssm_multipliers",),
    import_=_import_falcon_multipliers,
    export=lambda config: {
        "ssm_multipliers": [config.in_proj_multipliers.get(name, 1.0) for name in IN_PROJ_COMPONENTS]
    },
)


def _import_falcon_norm(data: Mapping[str, Any]) -> dict[str, Any]:
    # transformers' defaults: no norm (`mamba_rms_norm` false), normalize first (`mamba_norm_before_gate` true).
    # Without the norm the order means nothing (transformers' torch path computes y · silu(z)).
    enabled = bool(data.get("mamba_rms_norm", False))
    before = bool(data.get("mamba_norm_before_gate", True))
    return {"normalization.enabled": enabled, "normalization.norm_before_gate": enabled and before}


def _export_falcon_norm(config: Mamba2Config) -> dict[str, Any]:
    enabled = config.normalization.enabled
    # Without a norm, `mamba_norm_before_gate` is written as transformers' default (it reads it only with a norm).
    return {"mamba_rms_norm": enabled, "mamba_norm_before_gate": config.normalization.norm_before_gate or not enabled}


# Falcon-H1's output norm: `mamba_rms_norm` ↔ `normalization.enabled`, `mamba_norm_before_gate` ↔ its
# `norm_before_gate`, as FalconH1RMSNormGated and the mixer's torch path compute them (see docs/huggingface.md: the
# CUDA training path of transformers passes norm_before_gate=False to its fused kernel whatever the config says).
FALCON_H1_NORM = (
    Computed(
        ("normalization.enabled", "normalization.norm_before_gate"),
        ("mamba_rms_norm", "mamba_norm_before_gate"),
        import_=_import_falcon_norm,
        export=_export_falcon_norm,
    ),
)


def _import_falcon_epsilon(data: Mapping[str, Any]) -> dict[str, Any]:
    # Without the norm `rms_norm_eps` is only the model's norms' (the Mamba field keeps its default).
    if not data.get("mamba_rms_norm", False) or "rms_norm_eps" not in data:
        return {}
    return {"normalization.epsilon": data["rms_norm_eps"]}


# The norm's epsilon is `rms_norm_eps`, shared with the model's norms; a model without the Mamba norm writes only
# theirs (its unused epsilon cannot conflict with them).
FALCON_H1_EPSILON = Computed(
    ("normalization.epsilon",),
    ("rms_norm_eps",),
    import_=_import_falcon_epsilon,
    export=lambda config: {"rms_norm_eps": config.normalization.epsilon} if config.normalization.enabled else {},
)

SECTIONS["falcon_h1"] = mamba_2_section(
    name="mamba",
    keys=MAMBA_PREFIXED_KEYS,
    per_group=True,  # FalconH1RMSNormGated normalizes each of the `mamba_n_groups` groups
    time_step=_time_step_limit("time_step_limit"),
    head_size=Computed(
        ("head_size",),
        ("mamba_d_head", "mamba_d_ssm"),
        import_=_falcon_head_size,
        export=lambda config: {"mamba_d_head": config.head_size, "mamba_d_ssm": config.heads * config.head_size},
    ),
    biases=FALCON_H1_BIASES,
    in_proj_multipliers=FALCON_H1_IN_PROJ_MULTIPLIERS,
    norm_variant=FALCON_H1_NORM,
    epsilon=FALCON_H1_EPSILON,
    extra=(
        Ignored(
            theirs=("mamba_expand",),
            reason="read only when `mamba_d_ssm` is null; exports write the inner size as `mamba_d_ssm`",
        ),
    ),
)

# Granite-4.0 hybrid: Bamba's Mamba 2 layers (transformers' GraniteMoeHybridMambaLayer is BambaMixer), Bamba's keys.
SECTIONS["granitemoehybrid"] = SECTIONS["bamba"]
