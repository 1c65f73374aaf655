"""How the Gated DeltaNet mixer is written in the Hugging Face format `qwen3_next` (Qwen3NextForCausalLM, module
`linear_attn`; converter sections, see `blockzoo.conversion`). Torch-free at import.

The projections differ in layout: transformers has two, `in_proj_qkvz` whose rows are, for each key head, its q,
its k, then the v and z of the value heads that read it, and `in_proj_ba` with, for each key head, the b then the a
of those value heads; blockzoo has one `in_proj` of the components laid end to end (q of every key head, then k,
v, z, b, a), each key-head-major. So the rows are regrouped both ways, exactly. The convolution's weight changes
shape ([C, K] here, Conv1d's [C, 1, K] there), over the same q‖k‖v channels; the other parameters map one to one.
Qwen3-Next's projections and convolution have no biases.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from blockzoo.api import (
    Computed,
    ComputedWeights,
    ConversionError,
    Fixed,
    Ignored,
    Rename,
    Section,
    Weight,
    WeightMapping,
)
from blockzoo_gated_delta_net.config import IN_PROJ_COMPONENTS, GatedDeltaNetConfig
from blockzoo_ssm.conversion import CONVOLUTION_FILTERS


def _component_sizes(config: GatedDeltaNetConfig) -> dict[str, int]:
    """Rows of each component per key head."""
    group = config.value_heads // config.key_heads
    return {
        "q": config.key_head_size,
        "k": config.key_head_size,
        "v": group * config.value_head_size,
        "z": group * config.value_head_size,
        "b": group,
        "a": group,
    }


def _in_proj(config: GatedDeltaNetConfig) -> WeightMapping:
    sizes, heads = _component_sizes(config), config.key_heads
    qkvz, ba = ("q", "k", "v", "z"), ("b", "a")

    def per_head(tensor: Any, names: Sequence[str]) -> list[Any]:
        """[heads · Σ sizes, ...] laid out head-major → each component [heads · size, ...] (component-major)."""
        parts = tensor.unflatten(0, (heads, -1)).split([sizes[name] for name in names], dim=1)
        return [part.flatten(0, 1) for part in parts]

    def head_major(components: Sequence[Any]) -> Any:
        import torch

        return torch.cat([part.unflatten(0, (heads, -1)) for part in components], dim=1).flatten(0, 1)

    def import_(tensors: Sequence[Any]) -> list[Any]:
        import torch

        parts = dict(zip(qkvz, per_head(tensors[0], qkvz))) | dict(zip(ba, per_head(tensors[1], ba)))
        return [torch.cat([parts[name] for name in IN_PROJ_COMPONENTS])]

    def export(tensors: Sequence[Any]) -> list[Any]:
        parts = dict(zip(IN_PROJ_COMPONENTS, tensors[0].split([heads * sizes[name] for name in IN_PROJ_COMPONENTS])))
        return [head_major([parts[name] for name in qkvz]), head_major([parts[name] for name in ba])]

    return ComputedWeights(
        ("in_proj.weight",), ("in_proj_qkvz.weight", "in_proj_ba.weight"), import_=import_, export=export
    )


def _weights(config: GatedDeltaNetConfig) -> list[WeightMapping]:
    return [
        _in_proj(config),
        CONVOLUTION_FILTERS,
        Weight("dt_bias", "dt_bias"),
        Weight("a_log", "A_log"),
        Weight("normalization.weight", "norm.weight"),
        Weight("out_proj.weight", "out_proj.weight"),
    ]


_BIAS_FIELDS = (
    "add_linear_biases",
    "convolution.bias.enabled",
    *(f"{role}.bias.enabled" for role in (*IN_PROJ_COMPONENTS, "out_proj")),
)


def _no_biases(config: GatedDeltaNetConfig) -> dict[str, Any]:
    with_bias = [role for role in (*IN_PROJ_COMPONENTS, "out_proj") if config.has_bias(getattr(config, role))]
    if config.has_convolution_bias:
        with_bias.append("convolution")
    if with_bias:
        raise ConversionError(
            f"biases on {', '.join(with_bias)} cannot be written: Qwen3-Next's linear attention has none"
        )
    return {}


# Qwen3-Next's projections and convolution have no biases (imported as the defaults, which have none).
NO_BIASES = Computed(_BIAS_FIELDS, (), import_=lambda data: {"add_linear_biases": False}, export=_no_biases)

QWEN3_NEXT = Section(
    config_class=GatedDeltaNetConfig,
    name="linear_attn",
    config=(
        Rename("key_heads", "linear_num_key_heads"),
        Rename("value_heads", "linear_num_value_heads"),
        Rename("key_head_size", "linear_key_head_dim"),
        Rename("value_head_size", "linear_value_head_dim"),
        Rename("convolution.kernel_size", "linear_conv_kernel_dim"),
        NO_BIASES,
        Ignored(ours=("chunk_size",), reason="the torch path's chunking: speed and memory, not the result"),
        Rename("normalization.epsilon", "rms_norm_eps"),
        Fixed("hidden_act", "silu"),  # the convolution's activation (also the MLPs': Qwen3-Next's are silu)
    ),
    weights=_weights,
)


def register_sections(register: Callable[[str, Section], None]) -> None:
    """The Gated DeltaNet section of the Hugging Face formats with Gated DeltaNet layers."""
    register("qwen3_next", QWEN3_NEXT)
