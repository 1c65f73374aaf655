"""The Hugging Face formats of Mamba 1 and its hybrids: mamba (MambaForCausalLM), jamba (JambaForCausalLM),
apriel_hybrid_ssm (ServiceNow's remote code: attention, Mamba 1 in the grouped layout, discrete Mamba 2), with the
layouts of the two hybrids. Torch-free.

`apriel_hybrid_ssm`: the model type of Fast-LLM's `AprielHybridSSMConfig` (a MistralConfig with
`hybrid_block_layout` and `ssm_cfg`), whose modelling code builds "t" (Mistral), "m2", "m2d" and "i" (identity)
layers; the older `apriel_ssm_thinker_hybrid` (m2d only, with other `ssm_cfg` defaults and MTP heads) is not read.
Its modelling code pins transformers 4.x, so it is written in the 4.x form (`rope_theta`) unless asked otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from blockzoo.conversion import Computed, ConversionError, Ignored, Section, claimed_keys
from blockzoo.layers.config import NoMixerConfig, NoMLPConfig
from blockzoo.model.config import ModelConfig
from blockzoo_huggingface.format import HuggingfaceFormat
from blockzoo_huggingface.layouts import Layer, Uniform, _layer_count, merge_layers
from blockzoo_huggingface.sections import decoder_block, rms_norm, transformer_model

# The parts of a block a format leaves out (Mamba's blocks have no MLP; Apriel's identity layers have neither).
NO_MIXER = Section(config_class=NoMixerConfig)
NO_MLP = Section(config_class=NoMLPConfig)


def _check_types(layers: Sequence[Layer], allowed: Mapping[str, tuple[str, ...]], format_name: str) -> None:
    for index, layer in enumerate(layers):
        for part, types in allowed.items():
            if layer.types[part] not in types:
                raise ConversionError(
                    f"decoder.{index}.{part}: type {layer.types[part]!r} cannot be written in the {format_name} "
                    f"format (only {' or '.join(map(repr, types))})"
                )


# ---------------------------------------------------------------------------------------------------------------------
# Jamba: attention or Mamba, MoE or MLP, each every k-th layer from an offset


def _periodic(config: Mapping[str, Any], prefix: str, default: tuple[int, int], count: int) -> list[bool]:
    """Which layers `{prefix}_period` / `{prefix}_offset` select (i % period == offset)."""
    period, offset = config.get(f"{prefix}_period", default[0]), config.get(f"{prefix}_offset", default[1])
    if not isinstance(period, int) or not isinstance(offset, int) or not 0 <= offset < period:
        raise ConversionError(f"`{prefix}_offset` = {offset!r} must be in [0, `{prefix}_period` = {period!r})")
    return [index % period == offset for index in range(count)]


def _period(selected: Sequence[int], count: int, prefix: str, what: str, format_name: str) -> dict[str, int]:
    """The smallest period (and its offset) that selects exactly the layers `selected`; none: a period past the
    last layer."""
    if not selected:
        return {f"{prefix}_period": count + 1, f"{prefix}_offset": count}
    offset = selected[0]
    for period in range(offset + 1, count + 1):
        if [index for index in range(count) if index % period == offset] == list(selected):
            return {f"{prefix}_period": period, f"{prefix}_offset": offset}
    raise ConversionError(
        f"the {what} layers {list(selected)} are not every k-th layer from an offset below k: the {format_name} format "
        f"places them by `{prefix}_period` and `{prefix}_offset`"
    )


@attrs.frozen
class JambaLayers:
    """Layer i is attention when i % attn_layer_period == attn_layer_offset, else Mamba; its MLP a MoE when
    i % expert_layer_period == expert_layer_offset and num_experts > 1, else dense."""

    @property
    def claims(self) -> tuple[str, ...]:
        return (
            "num_hidden_layers",
            "attn_layer_period",
            "attn_layer_offset",
            "expert_layer_period",
            "expert_layer_offset",
        )

    def layers(self, config: Mapping[str, Any]) -> list[Layer]:
        count = _layer_count(config)
        attention = _periodic(config, "attn_layer", (8, 4), count)
        experts = _periodic(config, "expert_layer", (2, 1), count)
        moe = config.get("num_experts", 16) > 1
        return [
            Layer({"mixer": "attention" if a else "mamba", "mlp": "moe" if e and moe else "mlp"}, config)
            for a, e in zip(attention, experts)
        ]

    def merge(self, layers: Sequence[Layer], format_name: str) -> dict[str, Any]:
        _check_types(layers, {"mixer": ("attention", "mamba"), "mlp": ("mlp", "moe")}, format_name)
        merged = merge_layers(layers, format_name)
        count = len(layers)
        attention = [index for index, layer in enumerate(layers) if layer.types["mixer"] == "attention"]
        moe = [index for index, layer in enumerate(layers) if layer.types["mlp"] == "moe"]
        if moe and merged["num_experts"] < 2:
            raise ConversionError(
                f"a MoE of {merged['num_experts']} expert cannot be written: the {format_name} format "
                "makes layers with one expert dense MLPs"
            )
        return {
            **merged,
            "num_hidden_layers": count,
            **_period(attention, count, "attn_layer", "attention", format_name),
            **_period(moe, count, "expert_layer", "MoE", format_name),
            **({} if moe else {"num_experts": 1}),  # no MoE layer: every layer dense, whatever the period says
        }


# ---------------------------------------------------------------------------------------------------------------------
# Apriel hybrid SSM: one layer code per layer, the SSM mixers' keys in `ssm_cfg`

# Layer code -> block part types.
APRIEL_LAYERS = {
    "t": {"mixer": "attention", "mlp": "mlp"},
    "m2": {"mixer": "mamba", "mlp": "mlp"},
    "m2d": {"mixer": "discrete_mamba_2", "mlp": "mlp"},
    "i": {"mixer": "none", "mlp": "none"},
}
# The `ssm_cfg` their config class completes a config.json's with (Fast-LLM, `configuration_apriel_hybrid_ssm.py`).
APRIEL_SSM_DEFAULTS = {
    "d_state": 64,
    "n_v_heads": 32,
    "n_qk_heads": 32,
    "expand": 1,
    "chunk_size": 128,
    "activation": "identity",
    "bias": False,
    "d_conv": 4,
    "d_inner": 32 * 128,
    "d_xb": None,
    "dt_rank": "auto",
    "dt_min": 0.001,
    "dt_max": 0.1,
    "dt_init": "random",
    "dt_scale": 1.0,
    "dt_init_floor": 1e-4,
    "conv_bias": True,
    "dt_proj_bias": True,
    "repeat_kv_before_conv": True,
}
_SSM_PREFIX = "ssm_cfg."


@attrs.frozen
class AprielLayers:
    """`hybrid_block_layout` lists each layer's code (`APRIEL_LAYERS`); the SSM mixers' sections read `ssm_cfg`'s
    keys as `ssm_cfg.KEY` (completed with their config class's defaults), one value for all layers."""

    format_name: str = "apriel_hybrid_ssm"

    @property
    def claims(self) -> tuple[str, ...]:
        return ("num_hidden_layers", "hybrid_block_layout", "ssm_cfg")

    def layers(self, config: Mapping[str, Any]) -> list[Layer]:
        codes = list(config.get("hybrid_block_layout", ["m2d"]))
        count = _layer_count(config)
        if unknown := sorted(set(codes) - set(APRIEL_LAYERS)):
            raise ConversionError(
                f"`hybrid_block_layout` has layers {unknown} blockzoo cannot express (it reads "
                f"{', '.join(APRIEL_LAYERS)})"
            )
        if len(codes) != count:
            raise ConversionError(
                f"`hybrid_block_layout` lists {len(codes)} layers but `num_hidden_layers` is {count}: their modelling "
                "code needs one code per layer"
            )
        ssm = {**APRIEL_SSM_DEFAULTS, **(config.get("ssm_cfg") or {})}
        known = claimed_keys(self.format_name)
        if unknown := sorted(key for key in ssm if _SSM_PREFIX + key not in known):
            raise ConversionError(f"`ssm_cfg` keys {unknown} are not understood by the {self.format_name} conversion")
        flat = {key: value for key, value in config.items() if key != "ssm_cfg"}
        flat.update({_SSM_PREFIX + key: value for key, value in ssm.items()})
        return [Layer(APRIEL_LAYERS[code], flat) for code in codes]

    def merge(self, layers: Sequence[Layer], format_name: str) -> dict[str, Any]:
        codes = []
        for index, layer in enumerate(layers):
            code = next((code for code, types in APRIEL_LAYERS.items() if types == dict(layer.types)), None)
            if code is None:
                raise ConversionError(
                    f"decoder.{index}: a block of mixer {layer.types['mixer']!r} and MLP {layer.types['mlp']!r} cannot "
                    f"be written in the {format_name} format (its layers: "
                    + ", ".join(f"{c} = {t['mixer']} + {t['mlp']}" for c, t in APRIEL_LAYERS.items())
                    + ")"
                )
            codes.append(code)
        merged = merge_layers(layers, format_name)
        ssm = {key[len(_SSM_PREFIX) :]: merged.pop(key) for key in list(merged) if key.startswith(_SSM_PREFIX)}
        return {
            **merged,
            "num_hidden_layers": len(layers),
            "hybrid_block_layout": codes,
            "ssm_cfg": {**APRIEL_SSM_DEFAULTS, **ssm},
        }


@attrs.frozen(kw_only=True)
class AprielFormat(HuggingfaceFormat):
    """Written for the transformers their modelling code pins (`transformers_version`) unless asked otherwise: the
    4.x form (`rope_theta`), which 5.x reads too, where a 4.x MistralConfig would ignore 5.x's `rope_parameters`."""

    transformers_version: str = "4.53.2"

    def export_config(self, model: ModelConfig, *, transformers_version: str | None = None, **options: Any) -> dict:
        version = transformers_version or self.transformers_version
        return HuggingfaceFormat.export_config(self, model, transformers_version=version, **options)


# Fast-LLM's export names its remote code so (copy configuration_/modeling_apriel_hybrid_ssm.py beside the weights).
APRIEL_AUTO_MAP = {
    "AutoConfig": "configuration_apriel_hybrid_ssm.AprielHybridSSMConfig",
    "AutoModel": "modeling_apriel_hybrid_ssm.AprielHybridSSMModel",
    "AutoModelForCausalLM": "modeling_apriel_hybrid_ssm.AprielHybridSSMForCausalLM",
}


def _mamba_intermediate_size(model: ModelConfig) -> dict[str, Any]:
    sizes = {
        block.mixer.resolved_inner_size(model.hidden_size)
        for _, block in model.decoder.expanded_blocks()
        if hasattr(block.mixer, "resolved_inner_size")  # a mamba mixer; anything else is refused by the layout
    }
    return {"intermediate_size": sizes.pop()} if len(sizes) == 1 else {}


MAMBA_FORMATS = (
    HuggingfaceFormat(
        name="mamba",
        model_type="mamba",
        architecture="MambaForCausalLM",
        layout=Uniform(mixer="mamba", mlp="none"),
        model_section=transformer_model(
            extra=(
                # Derived by transformers from expand × hidden_size (read from `expand`), written as it does.
                Computed((), ("intermediate_size",), export=_mamba_intermediate_size),
                Ignored(
                    theirs=("residual_in_fp32",),
                    reason="the precision of the residual stream below fp32; blockzoo's is the compute dtype",
                ),
                Ignored(theirs=("rescale_prenorm_residual",), reason="an initialization option"),
            ),
            prefix="backbone",
            embeddings="embeddings",
            final_norm="norm_f",
        ),
        core_sections=(decoder_block("norm", "norm"), rms_norm("layer_norm_epsilon"), NO_MLP),
        defaults={"layer_norm_epsilon": 1e-5, "tie_word_embeddings": True},
        default_rope_theta=None,
        ignored_tensors=(),
        description="Mamba 1: mixer-only blocks, tied embeddings by default",
    ),
    HuggingfaceFormat(
        name="jamba",
        model_type="jamba",
        architecture="JambaForCausalLM",
        layout=JambaLayers(),
        model_section=transformer_model(final_norm="final_layernorm"),
        core_sections=(decoder_block("input_layernorm", "pre_ff_layernorm"), rms_norm()),
        default_rope_theta=None,
        description="Jamba: attention (no RoPE) or Mamba 1 with dt/B/C norms, MoE or MLP, by period and offset",
    ),
    AprielFormat(
        name="apriel_hybrid_ssm",
        model_type="apriel_hybrid_ssm",
        architecture="AprielHybridSSMForCausalLM",
        layout=AprielLayers(),
        model_section=transformer_model(
            extra=(
                Computed(
                    (),
                    ("auto_map",),
                    export=lambda config: {"auto_map": APRIEL_AUTO_MAP},
                ),
            )
        ),
        core_sections=(decoder_block(), rms_norm(), NO_MIXER, NO_MLP),
        description="Apriel hybrid SSM (remote code): Mistral attention, Mamba 1 grouped (m2), discrete Mamba 2 (m2d)",
    ),
)
