"""The Mamba 2 section every format builds on: `mamba_2_section` and the config and weight mappings the formats
share (time step limit, biases, gated norm, in_proj multipliers, weights). Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
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
from blockzoo_mamba_2.huggingface.transformers_releases import read_float, transformers_norm_is_per_group, write_float
from blockzoo_ssm.conversion import convolution_weights


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
