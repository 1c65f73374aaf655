"""How the dense MLP is written in the Hugging Face formats (converter sections, see `blockzoo.conversion`).

Llama-style: `mlp.{gate,up,down}_proj`, gated, the activation in `hidden_act`; NemotronH's is not gated
(`up_proj`, `down_proj`, `mlp_hidden_act`). Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from blockzoo.api import (
    Computed,
    Concatenated,
    ConfigMapping,
    Constant,
    ConversionError,
    Rename,
    Section,
    Weight,
    WeightMapping,
    format_activation,
)
from blockzoo_mlp.config import DenseMLPConfig

_BIAS_FIELDS = ("add_linear_biases", "gate.bias.enabled", "up.bias.enabled", "down.bias.enabled")


def biases(theirs: str | None) -> ConfigMapping:
    """One flag `theirs` for the biases of gate, up and down (Llama's `mlp_bias`), or none at all (`theirs` None)."""

    def import_(data: Mapping[str, Any]) -> dict[str, Any]:
        return {"add_linear_biases": bool(data.get(theirs, False))} if theirs else {}

    def export(config: DenseMLPConfig) -> dict[str, Any]:
        roles = ("gate", "up", "down") if config.gated else ("up", "down")
        found = {role: config.has_bias(getattr(config, role)) for role in roles}
        if len(set(found.values())) > 1 or (theirs is None and any(found.values())):
            allowed = f"`{theirs}` sets the gate, up and down biases alike" if theirs else "the MLP has no biases"
            raise ConversionError(f"MLP biases {found} cannot be written: {allowed}")
        return {theirs: found["up"]} if theirs else {}

    return Computed(_BIAS_FIELDS, (theirs,) if theirs else (), import_=import_, export=export)


def _weights(config: DenseMLPConfig) -> list[WeightMapping]:
    mappings: list[WeightMapping] = [
        Concatenated("gate_up.weight", ("gate_proj.weight", "up_proj.weight"))
        if config.gated
        else Weight("up.weight", "up_proj.weight"),
        Weight("down.weight", "down_proj.weight"),
    ]
    if config.has_bias(config.up):
        mappings.append(
            Concatenated("gate_up.bias", ("gate_proj.bias", "up_proj.bias"))
            if config.gated
            else Weight("up.bias", "up_proj.bias")
        )
    if config.has_bias(config.down):
        mappings.append(Weight("down.bias", "down_proj.bias"))
    return mappings


# The formats without MLP multipliers (all but Falcon-H1's): exporting any other value is refused.
NO_MULTIPLIERS = (Constant("gate_multiplier", 1.0), Constant("down_multiplier", 1.0))


def _import_falcon_multipliers(data: Mapping[str, Any]) -> dict[str, Any]:
    multipliers = data.get("mlp_multipliers") or [1.0, 1.0]
    if not isinstance(multipliers, (list, tuple)) or len(multipliers) != 2:
        raise ConversionError(f"`mlp_multipliers` must be [gate, down], got {multipliers!r}")
    return {"gate_multiplier": float(multipliers[0]), "down_multiplier": float(multipliers[1])}


# Falcon-H1: `mlp_multipliers` = [gate, down] (the gate projection's output, the down projection's output).
FALCON_H1_MULTIPLIERS = (
    Computed(
        ("gate_multiplier", "down_multiplier"),
        ("mlp_multipliers",),
        import_=_import_falcon_multipliers,
        export=lambda config: {"mlp_multipliers": [config.gate_multiplier, config.down_multiplier]},
    ),
)


def mlp_section(
    *,
    bias: str | None = None,
    name: str = "mlp",
    gated: bool = True,
    activation: str = "hidden_act",
    multipliers: tuple[ConfigMapping, ...] = NO_MULTIPLIERS,
) -> Section:
    """A gated MLP `mlp.{gate,up,down}_proj` (or under `name`; without `gate_proj` unless `gated`) of width
    `intermediate_size`, its activation in `activation`; biases from `bias` (a key) or none; the mappings of its
    gate and down multipliers (`multipliers`, default: none in the format)."""
    return Section(
        config_class=DenseMLPConfig,
        name=name,
        config=(
            Rename("intermediate_size", "intermediate_size"),
            Constant("gated", gated),
            *multipliers,
            format_activation(activation),
            biases(bias),
        ),
        weights=_weights,
    )


def register_sections(register: Callable[[str, Section], None]) -> None:
    """The MLP section of every Hugging Face format with dense MLPs (the MoE formats: their dense layers)."""
    register("llama", mlp_section(bias="mlp_bias"))
    for format_name in (
        "mistral",
        "qwen2",
        "qwen3",
        "qwen2_moe",
        "qwen3_moe",
        "qwen3_next",
        "apriel_hybrid_ssm",
        "deepseek_v3",
    ):
        register(format_name, mlp_section())
    register("jamba", mlp_section(name="feed_forward"))
    register("bamba", mlp_section(bias="mlp_bias", name="feed_forward"))
    register("falcon_h1", mlp_section(bias="mlp_bias", name="feed_forward", multipliers=FALCON_H1_MULTIPLIERS))
    register("nemotron_h", mlp_section(bias="mlp_bias", name="mixer", gated=False, activation="mlp_hidden_act"))
