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
"""

from __future__ import annotations

import importlib.metadata
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from blockzoo.api import (
    Computed,
    ConfigMapping,
    Constant,
    ConversionError,
    Fixed,
    Ignored,
    Rename,
    Section,
    Weight,
    WeightMapping,
)
from blockzoo_mamba_2.config import IN_PROJ_COMPONENTS, Mamba2Config
from blockzoo_ssm.conversion import convolution_weights

# transformers 5 writes the floats JSON lacks as {"__float__": "Infinity"} (4.x as a bare `Infinity`).
_FLOAT_TAG = "__float__"
_TAGGED_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def read_float(value: Any) -> float:
    """A float of a config.json, either form."""
    if isinstance(value, Mapping) and set(value) == {_FLOAT_TAG} and value[_FLOAT_TAG] in _TAGGED_FLOATS:
        return _TAGGED_FLOATS[value[_FLOAT_TAG]]
    return float(value)


def write_float(value: float) -> Any:
    """A float as transformers 5 writes it in a config.json."""
    return {_FLOAT_TAG: "Infinity"} if value == math.inf else value


def transformers_release_at_least(release: tuple[int, int], version: str | None = None) -> bool:
    """Whether transformers `version` (None: the installed one; none installed: the newest) is `release` or later."""
    if version is None:
        try:
            version = importlib.metadata.version("transformers")
        except importlib.metadata.PackageNotFoundError:
            return True
    found = re.match(r"(\d+)\.(\d+)", str(version))
    return found is None or (int(found[1]), int(found[2])) >= release


def _time_step_limit(key: str) -> ConfigMapping:
    """`dt_limit` ↔ `time_step_limit` ([min, max], the time step is clamped to it)."""

    def import_(data: Mapping[str, Any]) -> dict[str, Any]:
        limit = data.get(key, (0.0, math.inf))
        if not isinstance(limit, (list, tuple)) or len(limit) != 2:
            raise ConversionError(f"`{key}` must be [min, max], got {limit!r}")
        return {"dt_limit": tuple(read_float(value) for value in limit)}

    return Computed(
        ("dt_limit",),
        (key,),
        import_=import_,
        export=lambda config: {key: [write_float(value) for value in config.dt_limit]},
    )


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

_BIAS_FIELDS = ("add_linear_biases", *(f"{role}.bias.enabled" for role in (*IN_PROJ_COMPONENTS, "out_proj")))


def _projection_biases(key: str) -> ConfigMapping:
    """One flag for the biases of in_proj and out_proj."""

    def export(config: Mamba2Config) -> dict[str, Any]:
        in_proj, out_proj = config.has_bias(config.z), config.has_bias(config.out_proj)
        if in_proj != out_proj:
            raise ConversionError(
                f"in_proj bias {in_proj}, out_proj bias {out_proj} cannot be written: `{key}` sets both alike"
            )
        return {key: in_proj}

    return Computed(
        _BIAS_FIELDS, (key,), import_=lambda data: {"add_linear_biases": bool(data.get(key, False))}, export=export
    )


def _convolution_bias(key: str) -> ConfigMapping:
    # blockzoo's convolution bias is on unless disabled (`enabled` None means on).
    return Computed(
        ("convolution.bias.enabled",),
        (key,),
        import_=lambda data: {"convolution.bias.enabled": None if data.get(key, True) else False},
        export=lambda config: {key: config.convolution.has_bias},
    )


# transformers' Mamba2 and Bamba normalize per group since this release, over the whole inner dimension before.
_PER_GROUP_SINCE = (5, 23)


def transformers_norm_is_per_group(version: str | None) -> bool:
    """Whether transformers `version` (None: the installed one; none installed: the newest) normalizes per group."""
    return transformers_release_at_least(_PER_GROUP_SINCE, version)


def _grouped_norm(per_group: bool | None) -> ConfigMapping:
    """The format's gated norm: statistics per group (`per_group` true) or over the whole inner dimension (false),
    or as the transformers release does (None: Mamba2 and Bamba changed in 5.23). With one group the two are the
    same, and either is written."""

    def import_(data: Mapping[str, Any]) -> dict[str, Any]:
        grouped = (
            per_group if per_group is not None else transformers_norm_is_per_group(data.get("transformers_version"))
        )
        return {"normalization.per_group": grouped}

    def export(config: Mamba2Config) -> dict[str, Any]:
        grouped = per_group if per_group is not None else transformers_norm_is_per_group(None)
        normalization = config.normalization
        if normalization.enabled and normalization.per_group != grouped and config.groups > 1:
            where = "per group" if grouped else "over the whole inner dimension"
            raise ConversionError(
                f"`normalization.per_group` = {config.normalization.per_group} with {config.groups} groups cannot be "
                f"written: the format normalizes {where} (in the installed transformers)"
            )
        return {}

    return Computed(("normalization.per_group",), (), import_=import_, export=export)


def _weights(config: Mamba2Config) -> list[WeightMapping]:
    mappings: list[WeightMapping] = [
        Weight("in_proj.weight", "in_proj.weight"),
        *convolution_weights(config.convolution),
        Weight("dt_bias", "dt_bias"),
        Weight("a_log", "A_log"),
        Weight("d", "D"),
        Weight("out_proj.weight", "out_proj.weight"),
    ]
    if config.normalization.enabled:  # without a norm there is no weight (transformers: nn.Identity)
        mappings.append(Weight("normalization.weight", "norm.weight"))
    if config.has_bias(config.z):
        mappings.append(Weight("in_proj.bias", "in_proj.bias"))
    if config.has_bias(config.out_proj):
        mappings.append(Weight("out_proj.bias", "out_proj.bias"))
    return mappings


def _check_no_in_proj_multipliers(config: Mamba2Config) -> dict[str, Any]:
    if any(value != 1 for value in config.in_proj_multipliers.values()):
        raise ConversionError(
            f"`in_proj_multipliers` {config.in_proj_multipliers} cannot be written: this format has none"
        )
    return {}


# The formats without per-component in_proj multipliers (all but Falcon-H1's).
NO_IN_PROJ_MULTIPLIERS = Computed(
    ("in_proj_multipliers",),
    (),
    import_=lambda data: {"in_proj_multipliers": {}},
    export=_check_no_in_proj_multipliers,
)


# The formats whose transformers model always gates, then normalizes (all but Falcon-H1's).
GATE_THEN_NORM = (Constant("normalization.enabled", True), Constant("normalization.norm_before_gate", False))


def mamba_2_section(
    *,
    name: str,
    keys: Mapping[str, str],
    per_group: bool | None,
    time_step: ConfigMapping,
    head_size: ConfigMapping | None = None,
    biases: ConfigMapping | None = None,
    in_proj_multipliers: ConfigMapping = NO_IN_PROJ_MULTIPLIERS,
    norm_variant: tuple[ConfigMapping, ...] = GATE_THEN_NORM,
    epsilon: ConfigMapping | None = None,
    extra: tuple[ConfigMapping, ...] = (),
) -> Section:
    """A Mamba 2 mixer under module `name`. `keys`: the format's key of each of heads, head_size, groups,
    state_size, kernel_size, chunk_size, bias, convolution_bias, epsilon and activation (the convolution's, only
    silu). `per_group`: how the format's gated norm takes its statistics (None: as the transformers release does).
    `time_step`: the mapping of `dt_limit`;
    `head_size`: of `head_size`, when not a plain key; `biases`: of the projections' biases, when not one key for
    both (`keys["bias"]`); `in_proj_multipliers`: of those multipliers (default: none in the format);
    `norm_variant`: of `normalization.enabled` and `norm_before_gate` (default: the format always gates, then
    normalizes); `epsilon`: of the norm's epsilon, when not a plain key (`keys["epsilon"]`)."""
    return Section(
        config_class=Mamba2Config,
        name=name,
        config=(
            Rename("heads", keys["heads"]),
            head_size if head_size is not None else Rename("head_size", keys["head_size"]),
            Rename("groups", keys["groups"]),
            Rename("state_size", keys["state_size"]),
            Rename("chunk_size", keys["chunk_size"]),
            Rename("convolution.kernel_size", keys["kernel_size"]),
            _convolution_bias(keys["convolution_bias"]),
            biases if biases is not None else _projection_biases(keys["bias"]),
            time_step,
            Constant("d_per_channel", False),
            in_proj_multipliers,
            epsilon if epsilon is not None else Rename("normalization.epsilon", keys["epsilon"]),
            _grouped_norm(per_group),
            *norm_variant,
            Fixed(keys["activation"], "silu"),
            Ignored(ours=("recompute_convolution",), reason="what the backward pass keeps: memory, not the result"),
            *extra,
        ),
        weights=_weights,
    )


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


def register_sections(register: Callable[[str, Section], None]) -> None:
    """The Mamba 2 section of every Hugging Face format with Mamba 2 layers."""
    for format_name, section in SECTIONS.items():
        register(format_name, section)
