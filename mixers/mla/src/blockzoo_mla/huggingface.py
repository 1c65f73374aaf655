"""How multi-head latent attention is written in the Hugging Face formats (converter sections, see
`blockzoo.conversion`): DeepSeek-V3's `self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}, kv_a_proj_with_mqa,
kv_a_layernorm, kv_b_proj, o_proj`, one to one (the same row layouts; `rope_interleave` is our `interleaved_rotary`).

YaRN: transformers scales DeepSeek's logits by mscale(factor, mscale_all_dim)² (our `softmax_scale`) and the rotary
tables by mscale(factor, mscale) / mscale(factor, mscale_all_dim) (the yarn rotary's `attention_factor`). Import
computes both; export writes `attention_factor` and the `mscale_all_dim` that gives the softmax scale, an equivalent
rope_parameters (a config with `mscale` comes back with `attention_factor` in its place). Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from blockzoo.api import (
    Computed,
    ConversionError,
    Fixed,
    Ignored,
    Nested,
    Rename,
    Section,
    Weight,
    WeightMapping,
    get_registry,
)
from blockzoo_attention.huggingface import ROTARY
from blockzoo_mla.config import MLAConfig

_BIAS_FIELDS = (
    "add_linear_biases",
    "query.bias.enabled",
    "query_down.bias.enabled",
    "query_up.bias.enabled",
    "key_value_down.bias.enabled",
    "key_value_up.bias.enabled",
    "dense.bias.enabled",
)
# attention_bias: the projections from and to the hidden state have biases; q_proj and the up projections never.
_WITH_BIAS = ("query_down", "key_value_down", "dense")
_WITHOUT_BIAS = ("query", "query_up", "key_value_up")


def _import_biases(data: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "add_linear_biases": bool(data.get("attention_bias", False)),
        **{f"{role}.bias.enabled": False for role in _WITHOUT_BIAS},
    }


def _export_biases(config: MLAConfig) -> dict[str, Any]:
    used = ("query_down",) if config.query_rank is not None else ()
    biases = {role: config.has_bias(getattr(config, role)) for role in (*used, "key_value_down", "dense")}
    never = {role: config.has_bias(getattr(config, role)) for role in _WITHOUT_BIAS}
    if len(set(biases.values())) > 1 or any(never.values()):
        raise ConversionError(
            f"MLA biases {biases | never} cannot be written: `attention_bias` sets the biases of q_a_proj, "
            "kv_a_proj_with_mqa and o_proj alike; q_proj, q_b_proj and kv_b_proj have none"
        )
    return {"attention_bias": biases["dense"]}


def _mscale(factor: float, multiplier: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * multiplier * math.log(factor) + 1.0


def _import_rotary(data: Mapping[str, Any]) -> dict[str, Any]:
    rope = dict(data.get("rope_parameters") or {})
    mscale, mscale_all_dim = rope.pop("mscale", None), rope.pop("mscale_all_dim", None)
    rotary = ROTARY.import_({"rope_parameters": rope} if rope else {})["rotary"]
    scale = None
    if rotary["type"] != "default" and (mscale is not None or mscale_all_dim is not None):
        if rotary["type"] != "yarn":
            raise ConversionError("`rope_parameters.mscale` / `mscale_all_dim` are supported with rope_type yarn only")
        factor = rotary.get("scale_factor", 8.0)
        if rotary.get("attention_factor") is None and mscale and mscale_all_dim:
            rotary["attention_factor"] = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
        if mscale_all_dim:
            head = data["qk_nope_head_dim"] + data["qk_rope_head_dim"]
            scale = head**-0.5 * _mscale(factor, mscale_all_dim) ** 2
    return {"rotary": rotary, "softmax_scale": scale}


def _export_rotary(config: MLAConfig) -> dict[str, Any]:
    rope = dict(ROTARY.export(config)["rope_parameters"])
    base = config.query_key_head_size**-0.5
    if math.isclose(config.resolved_softmax_scale, base, rel_tol=1e-12):
        return {"rope_parameters": rope}
    factor = rope.get("factor", 1.0)
    if rope["rope_type"] != "yarn" or factor <= 1 or config.resolved_softmax_scale < base:
        raise ConversionError(
            f"`softmax_scale` {config.softmax_scale} cannot be written: the format uses (qk_nope_head_dim + "
            "qk_rope_head_dim)**-0.5, times YaRN's mscale(factor, mscale_all_dim)² (rope_type yarn, factor > 1)"
        )
    multiplier = (math.sqrt(config.resolved_softmax_scale / base) - 1.0) / (0.1 * math.log(factor))
    return {"rope_parameters": {**rope, "mscale_all_dim": float(f"{multiplier:.12g}")}}


def _check_head_sizes(data: Mapping[str, Any]) -> dict[str, Any]:
    # transformers derives both (head_dim: the rotary embedding's size) and writes them; they must agree.
    expected = {
        "num_key_value_heads": data["num_attention_heads"],
        "head_dim": data["qk_rope_head_dim"],
        "qk_head_dim": data["qk_nope_head_dim"] + data["qk_rope_head_dim"],
    }
    for key, value in expected.items():
        if data.get(key) is not None and data[key] != value:
            raise ConversionError(f"`{key}` = {data[key]!r}: DeepSeek-V3's attention needs {value}")
    return {}


def _export_head_sizes(config: MLAConfig) -> dict[str, Any]:
    return {
        "num_key_value_heads": config.heads,
        "head_dim": config.rotary_head_size,
        "qk_head_dim": config.query_key_head_size,
    }


# transformers builds q_a_layernorm and kv_a_layernorm with DeepseekV3RMSNorm's own epsilon, whatever rms_norm_eps is.
_NORM_EPSILON = 1e-6
_NORMS = ("query_norm", "key_value_norm")


def _export_norms(config: MLAConfig) -> dict[str, Any]:
    for role in _NORMS:
        norm = getattr(config, role)
        if get_registry().name_of(type(norm)) != "rms_norm" or norm.epsilon != _NORM_EPSILON:
            raise ConversionError(
                f"`{role}` = {norm!r} cannot be written: DeepSeek-V3's q_a_layernorm and kv_a_layernorm are RMS norms "
                f"of epsilon {_NORM_EPSILON}"
            )
    return {}


NORMS = Computed(
    _NORMS,
    (),
    import_=lambda data: {role: {"type": "rms_norm", "epsilon": _NORM_EPSILON} for role in _NORMS},
    export=_export_norms,
)


def _weights(config: MLAConfig) -> list[WeightMapping | Nested]:
    mappings: list[WeightMapping | Nested] = []
    if config.query_rank is None:
        mappings.append(Weight("query.weight", "q_proj.weight"))
    else:
        mappings += [
            Weight("query_down.weight", "q_a_proj.weight"),
            Nested("query_norm", config.query_norm, "q_a_layernorm"),
            Weight("query_up.weight", "q_b_proj.weight"),
        ]
    mappings += [
        Weight("key_value_down.weight", "kv_a_proj_with_mqa.weight"),
        Nested("key_value_norm", config.key_value_norm, "kv_a_layernorm"),
        Weight("key_value_up.weight", "kv_b_proj.weight"),
        Weight("dense.weight", "o_proj.weight"),
    ]
    if config.has_bias(config.dense):
        if config.query_rank is not None:
            mappings.append(Weight("query_down.bias", "q_a_proj.bias"))
        mappings += [Weight("key_value_down.bias", "kv_a_proj_with_mqa.bias"), Weight("dense.bias", "o_proj.bias")]
    return mappings


def mla_section(name: str = "self_attn") -> Section:
    """DeepSeek-V3's attention (`DeepseekV3Attention`) under `name`."""
    return Section(
        config_class=MLAConfig,
        name=name,
        config=(
            Rename("heads", "num_attention_heads"),
            Rename("query_rank", "q_lora_rank"),
            Rename("key_value_rank", "kv_lora_rank"),
            Rename("nope_head_size", "qk_nope_head_dim"),
            Rename("rotary_head_size", "qk_rope_head_dim"),
            Rename("value_head_size", "v_head_dim"),
            Computed(
                (),
                ("num_key_value_heads", "head_dim", "qk_head_dim"),
                import_=_check_head_sizes,
                export=_export_head_sizes,
            ),
            Computed(_BIAS_FIELDS, ("attention_bias",), import_=_import_biases, export=_export_biases),
            Computed(("rotary", "softmax_scale"), ("rope_parameters",), import_=_import_rotary, export=_export_rotary),
            Rename("interleaved_rotary", "rope_interleave"),
            NORMS,
            Fixed("attention_dropout", 0.0),
            Ignored(
                ours=("implementation", "absorbed_decoding"),
                reason="the kernel and the decoding form are chosen at run time, not stored",
            ),
        ),
        weights=_weights,
    )


def register_sections(register: Callable[[str, Section], None]) -> None:
    """The MLA section of every Hugging Face format with multi-head latent attention."""
    register("deepseek_v3", mla_section())
