"""The hybrid models shipped as presets (`blockzoo models`): Falcon-H1, Nemotron-H, Granite 4.0 H and Qwen3-Next. They
live here, beside their formats: each combines layers of several plugins (attention, Mamba 2 or Gated DeltaNet, MLP or
MoE) that only its format ties together. Each is the architecture part of its published config.json, kept per family
in `presets_<family>.py`; this module is the catalogue: each preset's name, counts, distributions and notes, and the
plugin's registration. Torch-free."""

from __future__ import annotations

from blockzoo.api import Preset
from blockzoo_huggingface.presets_falcon_h1 import (
    FALCON_H1_0_5B,
    FALCON_H1_1_5B,
    FALCON_H1_1_5B_DEEP,
    FALCON_H1_3B,
    FALCON_H1_7B,
    FALCON_NOTE,
    STORED_FALCON_0_5B,
    STORED_FALCON_DOC,
    STORED_FALCON_NORM,
    STORED_FALCON_SWEEP,
)
from blockzoo_huggingface.presets_granite import GRANITE_4_0_H_TINY, GRANITE_NOTE, STORED_GRANITE
from blockzoo_huggingface.presets_nemotron_h import NEMOTRON_H_8B, NEMOTRON_NOTE, STORED_NEMOTRON
from blockzoo_huggingface.presets_qwen3_next import QWEN_3_NEXT_80B_A3B, QWEN_NEXT_NOTE, STORED_QWEN_NEXT

HF = "blockzoo-huggingface"
DEFAULTS_TAKEN = (
    "Initialization, learning-rate scales and weight decay are blockzoo's defaults (the config.json has only "
    "initializer_range, not read)."
)


def _published(family, repository, config, parameters, published, requires, *, active=None, notes="", checked=()):
    fields = {
        "requires": requires,
        "active_parameters": active,
        "notes": " ".join(filter(None, (notes, DEFAULTS_TAKEN))),
        "checked_against": tuple(checked),
    }
    return Preset.published(family, repository, config, parameters, published, **fields)


def _proxy(family, base_name, base, parameters, requires, *, active=None, **changes):
    notes = "Ours, not a published model: the family's structure at a size for one GPU. " + DEFAULTS_TAKEN
    fields = {"requires": requires, "active_parameters": active, "notes": notes}
    return Preset.proxy(family, base_name, base, parameters, changes=changes, **fields)


FALCON_REQUIRES = ("blockzoo-attention", "blockzoo-mamba-2", "blockzoo-mlp", HF)
NEMOTRON_REQUIRES = ("blockzoo-attention", "blockzoo-mamba-2", "blockzoo-mlp", HF)
GRANITE_REQUIRES = ("blockzoo-attention", "blockzoo-mamba-2", "blockzoo-moe", HF)
QWEN_NEXT_REQUIRES = ("blockzoo-attention", "blockzoo-gated-delta-net", "blockzoo-moe", HF)


def presets() -> dict[str, Preset]:
    falcon = dict(requires=FALCON_REQUIRES)
    larger_falcon = dict(
        falcon, notes=FALCON_NOTE, checked=(STORED_FALCON_SWEEP, STORED_FALCON_DOC, STORED_FALCON_NORM)
    )
    return {
        "falcon_h1_0_5b": _published(
            "Falcon-H1",
            "tiiuae/Falcon-H1-0.5B-Base",
            FALCON_H1_0_5B,
            521_411_104,
            "0.5B",
            checked=(STORED_FALCON_0_5B, STORED_FALCON_SWEEP, STORED_FALCON_DOC),
            **falcon,
        ),
        "falcon_h1_1_5b": _published(
            "Falcon-H1", "tiiuae/Falcon-H1-1.5B-Base", FALCON_H1_1_5B, 1_554_859_392, "1.5B", **larger_falcon
        ),
        "falcon_h1_1_5b_deep": _published(
            "Falcon-H1", "tiiuae/Falcon-H1-1.5B-Deep-Base", FALCON_H1_1_5B_DEEP, 1_554_872_208, "1.5B", **larger_falcon
        ),
        "falcon_h1_3b": _published(
            "Falcon-H1", "tiiuae/Falcon-H1-3B-Base", FALCON_H1_3B, 3_149_387_264, "3B", **larger_falcon
        ),
        "falcon_h1_7b": _published(
            "Falcon-H1", "tiiuae/Falcon-H1-7B-Base", FALCON_H1_7B, 7_585_648_736, "7B", **larger_falcon
        ),
        "nemotron_h_8b": _published(
            "Nemotron-H",
            "nvidia/Nemotron-H-8B-Base-8K",
            NEMOTRON_H_8B,
            8_100_852_736,
            "8B",
            NEMOTRON_REQUIRES,
            notes=NEMOTRON_NOTE,
            checked=STORED_NEMOTRON,
        ),
        "granite_4_0_h_tiny": _published(
            "Granite 4.0",
            "ibm-granite/granite-4.0-h-tiny",
            GRANITE_4_0_H_TINY,
            6_939_037_248,
            "7B (1B active)",
            GRANITE_REQUIRES,
            active=1_465_470_528,
            notes=GRANITE_NOTE,
            checked=STORED_GRANITE,
        ),
        "qwen3_next_80b_a3b": _published(
            "Qwen3-Next",
            "Qwen/Qwen3-Next-80B-A3B-Instruct",
            QWEN_3_NEXT_80B_A3B,
            79_674_391_296,
            "80B (3B active)",
            QWEN_NEXT_REQUIRES,
            active=3_874_929_408,
            notes=QWEN_NEXT_NOTE,
            checked=STORED_QWEN_NEXT,
        ),
        "falcon_h1_proxy_75m": _proxy(
            "Falcon-H1",
            "falcon_h1_0_5b",
            FALCON_H1_0_5B,
            73_040_816,
            FALCON_REQUIRES,
            hidden_size=512,
            intermediate_size=1024,
            num_attention_heads=4,
            mamba_n_heads=12,
            mamba_d_ssm=768,
            num_hidden_layers=12,
        ),
        "nemotron_h_proxy_260m": _proxy(
            "Nemotron-H",
            "nemotron_h_8b",
            NEMOTRON_H_8B,
            263_694_000,
            NEMOTRON_REQUIRES,
            hidden_size=768,
            intermediate_size=3072,
            num_attention_heads=12,
            num_key_value_heads=4,
            head_dim=64,
            mamba_num_heads=24,
            hybrid_override_pattern="M-M-M*-M-M-M*-",
            num_hidden_layers=14,
        ),
        "granite_4_0_h_proxy_370m": _proxy(
            "Granite 4.0",
            "granite_4_0_h_tiny",
            GRANITE_4_0_H_TINY,
            372_832_208,
            GRANITE_REQUIRES,
            active=202_962_896,
            hidden_size=768,
            num_attention_heads=12,
            mamba_n_heads=24,
            num_local_experts=16,
            num_experts_per_tok=4,
            layer_types=["mamba"] * 5 + ["attention"] + ["mamba"] * 5 + ["attention"],
            num_hidden_layers=12,
        ),
        "qwen3_next_proxy_320m": _proxy(
            "Qwen3-Next",
            "qwen3_next_80b_a3b",
            QWEN_3_NEXT_80B_A3B,
            324_206_544,
            QWEN_NEXT_REQUIRES,
            active=192_085_968,
            hidden_size=512,
            num_attention_heads=4,
            head_dim=128,
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            num_experts=32,
            num_experts_per_tok=4,
            moe_intermediate_size=256,
            shared_expert_intermediate_size=256,
            num_hidden_layers=12,
        ),
    }


def register_presets(register) -> None:
    for name, preset in presets().items():
        register(name, preset)
