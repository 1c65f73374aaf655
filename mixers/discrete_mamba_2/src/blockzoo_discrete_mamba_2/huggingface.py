"""How discrete Mamba 2 is written in the Hugging Face formats (converter sections, see `blockzoo.conversion`).

`apriel_hybrid_ssm` "m2d" layers (ServiceNow's remote code, `model.layers.N.mixer`, the `DiscreteMamba2` of
phi-mamba / Llamba): the same tensors as ours (`in_proj` rows [x, B, C, z, dt], `z_bias` when in_proj has no bias,
`D`), `conv1d.weight` [channels, 1, kernel]. Its keys are in the config's `ssm_cfg` dict, which the converter's
layout gives the sections as `ssm_cfg.KEY`. Torch-free: the weight mappings use torch only when they run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from blockzoo.api import (
    Computed,
    ConversionError,
    Rename,
    Section,
    Weight,
    WeightMapping,
)
from blockzoo_discrete_mamba_2.config import DiscreteMamba2Config
from blockzoo_ssm.conversion import convolution_weights

_BIAS_FIELDS = (
    "add_linear_biases",
    *(f"{linear}.bias.enabled" for linear in (*DiscreteMamba2Config.IN_PROJ_COMPONENTS, "out_proj")),
)
_ACTIVATIONS = {"identity": "identity", "silu": "silu", "swish": "silu"}


def _import_head_size(data: Mapping[str, Any]) -> dict[str, Any]:
    # As their modelling code: d_inner, or expand × the hidden size when it is None.
    inner_size = data["ssm_cfg.d_inner"]
    if inner_size is None:
        inner_size = data["ssm_cfg.expand"] * data["hidden_size"]
    heads = data["ssm_cfg.n_v_heads"]
    if inner_size % heads:
        raise ConversionError(f"`ssm_cfg.d_inner` = {inner_size} is not a multiple of `ssm_cfg.n_v_heads` = {heads}")
    return {"head_size": inner_size // heads}


def _import_groups(data: Mapping[str, Any]) -> dict[str, Any]:
    groups = data["ssm_cfg.n_qk_heads"]
    return {"groups": None if groups == data["ssm_cfg.n_v_heads"] else groups}  # None: one per head


def _import_activation(data: Mapping[str, Any]) -> dict[str, Any]:
    name = data["ssm_cfg.activation"]
    if name not in _ACTIVATIONS:
        raise ConversionError(f"`ssm_cfg.activation` = {name!r} is not supported (only identity or silu)")
    return {"activation": _ACTIVATIONS[name]}


def _export_biases(config: DiscreteMamba2Config) -> dict[str, Any]:
    found = {"in_proj": config.in_proj_has_bias, "out_proj": config.has_bias(config.out_proj)}
    if len(set(found.values())) > 1:
        raise ConversionError(f"discrete_mamba_2 biases {found} cannot be written: `ssm_cfg.bias` sets them alike")
    return {"ssm_cfg.bias": found["in_proj"]}


def _weights(config: DiscreteMamba2Config) -> list[WeightMapping]:
    mappings: list[WeightMapping] = [
        Weight("in_proj.weight", "in_proj.weight"),  # the same rows: [x, B, C, z, dt]
        *convolution_weights(config.convolution),
        Weight("d", "D"),
        Weight("out_proj.weight", "out_proj.weight"),
    ]
    if config.in_proj_has_bias:
        mappings.append(Weight("in_proj.bias", "in_proj.bias"))
    else:
        mappings.append(Weight("z_bias", "z_bias"))
    if config.has_bias(config.out_proj):
        mappings.append(Weight("out_proj.bias", "out_proj.bias"))
    return mappings


def apriel_section() -> Section:
    """The "m2d" layers of ServiceNow's `apriel_hybrid_ssm` (`mixer`), keys `ssm_cfg.*`."""
    return Section(
        config_class=DiscreteMamba2Config,
        name="mixer",
        config=(
            Rename("heads", "ssm_cfg.n_v_heads"),
            Computed(
                ("groups",),
                ("ssm_cfg.n_qk_heads",),
                import_=_import_groups,
                export=lambda config: {"ssm_cfg.n_qk_heads": config.resolved_groups},
            ),
            Computed(
                ("head_size",),
                ("ssm_cfg.d_inner", "ssm_cfg.expand"),
                import_=_import_head_size,
                export=lambda config: {"ssm_cfg.d_inner": config.inner_size},
            ),
            Rename("state_size", "ssm_cfg.d_state"),
            Rename("chunk_size", "ssm_cfg.chunk_size"),
            Rename("convolution.kernel_size", "ssm_cfg.d_conv"),
            Computed(
                ("convolution.bias.enabled",),
                ("ssm_cfg.conv_bias",),
                # A bias is blockzoo's default (`enabled` None): imported so.
                import_=lambda data: {"convolution.bias.enabled": None if data["ssm_cfg.conv_bias"] else False},
                export=lambda config: {"ssm_cfg.conv_bias": config.convolution.has_bias},
            ),
            Computed(
                ("activation",),
                ("ssm_cfg.activation",),
                import_=_import_activation,
                export=lambda config: {"ssm_cfg.activation": config.activation},
            ),
            Computed(
                _BIAS_FIELDS,
                ("ssm_cfg.bias",),
                import_=lambda data: {"add_linear_biases": bool(data["ssm_cfg.bias"])},
                export=_export_biases,
            ),
        ),
        weights=_weights,
    )


def register_sections(register: Callable[[str, Section], None]) -> None:
    """The discrete Mamba 2 section of every Hugging Face format with such layers."""
    register("apriel_hybrid_ssm", apriel_section())
