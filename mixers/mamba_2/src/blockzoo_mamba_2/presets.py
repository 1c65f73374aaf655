"""The Mamba 2 language models this plugin ships as presets (`blockzoo models`): the state-spaces Mamba 2 family of
the paper (130M to 2.7B) and a proxy of ours.

The published checkpoints (state-spaces/mamba2-*) have mamba_ssm's config.json (`d_model`, `n_layer`, `vocab_size`
50277, `pad_vocab_size_multiple` 16, `ssm_cfg: {layer: Mamba2}`, `tie_embeddings`); the Mamba 2 layer then takes
mamba_ssm's defaults (`d_state` 128, `headdim` 64, `expand` 2, `ngroups` 1, `d_conv` 4, `chunk_size` 256, a gated
RMSNorm after the gate). Each preset is that, written as transformers' Mamba 2 config.json (the vocabulary padded to
50288 as mamba_ssm pads it; heads = 2 × d_model / 64), read through the Hugging Face `mamba2` format. Torch-free.
"""

from __future__ import annotations

from blockzoo.api import Preset

REQUIRES = ("blockzoo-mamba-2", "blockzoo-huggingface")
NOTE = (
    "Values from the mamba_ssm config.json named in `source` and mamba_ssm's Mamba2 defaults (d_state 128, headdim 64, "
    "expand 2, ngroups 1, d_conv 4, chunk_size 256); the vocabulary is padded to a multiple of 16 (50288) as mamba_ssm "
    "does. Initialization, learning-rate scales and weight decay are blockzoo's defaults."
)


def mamba2_config(d_model: int, n_layer: int) -> dict:
    return {
        "model_type": "mamba2",
        "architectures": ["Mamba2ForCausalLM"],
        "chunk_size": 256,
        "conv_kernel": 4,
        "expand": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": d_model,
        "layer_norm_epsilon": 1e-05,
        "n_groups": 1,
        "num_heads": 2 * d_model // 64,
        "num_hidden_layers": n_layer,
        "residual_in_fp32": True,
        "state_size": 128,
        "tie_word_embeddings": True,
        "use_bias": False,
        "use_conv_bias": True,
        "vocab_size": 50288,
    }


# Stored copies of the published values (`checked_against`): where each was read, and what it confirms.
STORED = (
    "github.com/state-spaces/mamba README.md@25c9b9a7 (the pretrained mamba2-130m ... mamba2-2.7b follow the GPT-3 "
    "dimensions: 24 layers of 768, 48 of 1024, 48 of 1536, 48 of 2048, 64 of 2560)",
    "github.com/state-spaces/mamba mamba_ssm/modules/mamba2.py@8ffd905c (Mamba2 defaults: d_state 128, d_conv 4, "
    "expand 2, headdim 64, ngroups 1, rmsnorm, norm_before_gate False, no bias, conv bias, chunk_size 256)",
    "a checkpoint-preparation test on the official state-spaces config.json (d_model 768, n_layer 24, vocab_size "
    "50277, pad_vocab_size_multiple 16, ssm_cfg layer Mamba2 -> vocabulary 50288, 24 heads of 64, state 128); "
    "found by exact-string search",
)

# name: (d_model, n_layer, parameters, published)
SIZES = {
    "mamba2_130m": (768, 24, 128_989_632, "130M"),
    "mamba2_370m": (1024, 48, 368_346_624, "370M"),
    "mamba2_780m": (1536, 48, 780_161_280, "780M"),
    "mamba2_1_3b": (2048, 48, 1_343_757_312, "1.3B"),
    "mamba2_2_7b": (2560, 64, 2_702_599_680, "2.7B"),
}


def presets() -> dict[str, Preset]:
    found = {
        name: Preset(
            family="Mamba 2",
            format="mamba2",
            format_config=mamba2_config(d_model, n_layer),
            parameters=parameters,
            published_parameters=published,
            source=f"https://huggingface.co/state-spaces/{repository}/blob/main/config.json",
            requires=REQUIRES,
            notes=NOTE,
            checked_against=STORED,
        )
        for name, (d_model, n_layer, parameters, published) in SIZES.items()
        for repository in [name.replace("_", "-", 1).replace("_", ".")]
    }
    found["mamba2_proxy_50m"] = Preset(
        family="Mamba 2",
        format="mamba2",
        format_config=mamba2_config(512, 12),
        parameters=46_389_312,
        source="ours: mamba2_130m with d_model 512, 12 layers",
        requires=REQUIRES,
        notes="Ours, not a published model: the family's architecture for quick experiments on one GPU. " + NOTE,
    )
    return found


def register_presets(register) -> None:
    for name, preset in presets().items():
        register(name, preset)
