"""How attention is written in the Hugging Face formats (converter sections, see `blockzoo.conversion`).

The sections read the transformers 5 form of the config: the converter turns a 4.x config (`rope_theta`,
`rope_scaling`) into `rope_parameters` before they see it, and back when it writes for 4.x. Per-layer values
(Qwen2's sliding-window layers) are put in place by the converter's layer layout. Torch-free.

The package's modules: `config_mappings` (rotary embeddings, biases, windows, the features most formats lack),
`weight_mappings` (the projections and head norms), `section` (`attention_section`, the section built from them),
`model_families` (what only one family uses: Qwen3-MoE, Qwen3-Next, Granite) and, here, `register_sections`.
"""

from __future__ import annotations

from collections.abc import Callable

from blockzoo.api import Constant, Ignored, Rename, Section
from blockzoo_attention.huggingface.config_mappings import (
    NO_KEY_MULTIPLIER,
    NO_OUTPUT_GATE,
    NO_ROTARY,
    ROTARY,
    all_biases,
    partial_rotary,
    qkv_biases,
    sliding_window,
)
from blockzoo_attention.huggingface.model_families import (
    GRANITE_ROTARY,
    GRANITE_SOFTMAX_SCALE,
    IMPLIED_HEAD_SIZE,
    OUTPUT_GATE,
    QWEN3_WINDOW,
)
from blockzoo_attention.huggingface.section import attention_section

__all__ = [
    "GRANITE_ROTARY",
    "GRANITE_SOFTMAX_SCALE",
    "IMPLIED_HEAD_SIZE",
    "NO_KEY_MULTIPLIER",
    "NO_OUTPUT_GATE",
    "NO_ROTARY",
    "OUTPUT_GATE",
    "QWEN3_WINDOW",
    "ROTARY",
    "all_biases",
    "attention_section",
    "partial_rotary",
    "qkv_biases",
    "register_sections",
    "sliding_window",
]


def register_sections(register: Callable[[str, Section], None]) -> None:
    """The attention section of every Hugging Face format with attention."""
    register("llama", attention_section(biases=all_biases("attention_bias"), window=Constant("window_size", None)))
    register("mistral", attention_section(biases=all_biases(None), window=sliding_window(default=4096)))
    register("mixtral", attention_section(biases=all_biases(None), window=sliding_window(default=None)))
    # Qwen2 and Qwen2-MoE: the converter's layout gives each layer its `sliding_window` (None where full).
    register("qwen2", attention_section(biases=qkv_biases(None), window=sliding_window(default=None)))
    register("qwen2_moe", attention_section(biases=qkv_biases("qkv_bias"), window=sliding_window(default=None)))
    register(
        "qwen3",
        attention_section(biases=all_biases("attention_bias"), window=sliding_window(default=None), head_norms=True),
    )
    register("qwen3_moe", attention_section(biases=all_biases("attention_bias"), window=QWEN3_WINDOW, head_norms=True))
    # Qwen3-Next: gated attention, RoPE on a quarter of each head by default, (1 + w) head norms (the format's norms).
    register(
        "qwen3_next",
        attention_section(
            biases=all_biases("attention_bias"),
            window=Constant("window_size", None),
            head_norms=True,
            rotary=partial_rotary(0.25),
            output_gate=OUTPUT_GATE,
            norm_offset=1.0,
        ),
    )
    register(
        "granitemoehybrid",
        attention_section(
            biases=all_biases("attention_bias"),
            window=Constant("window_size", None),
            rotary=GRANITE_ROTARY,
            softmax_scale=GRANITE_SOFTMAX_SCALE,
            head_size=IMPLIED_HEAD_SIZE,
        ),
    )
    # Falcon-H1: Llama's attention, its keys scaled by `key_multiplier`.
    register(
        "falcon_h1",
        attention_section(
            biases=all_biases("attention_bias"),
            window=Constant("window_size", None),
            key_multiplier=Rename("key_multiplier", "key_multiplier", default=1.0),
        ),
    )
    # The Mamba hybrids: Jamba's attention has no rotary embeddings; Apriel's "t" layers are Mistral's.
    register(
        "jamba", attention_section(biases=all_biases(None), window=Constant("window_size", None), rotary=NO_ROTARY)
    )
    register("apriel_hybrid_ssm", attention_section(biases=all_biases(None), window=sliding_window(default=4096)))
    # Bamba: RoPE on half of each head unless `partial_rotary_factor` says otherwise. NemotronH: no RoPE, no biases.
    register(
        "bamba",
        attention_section(
            biases=all_biases("attention_bias"), window=Constant("window_size", None), rotary=partial_rotary(0.5)
        ),
    )
    register(
        "nemotron_h",
        attention_section(
            biases=all_biases(None),
            window=Constant("window_size", None),
            rotary=NO_ROTARY,
            name="mixer",
            extra=(
                Ignored(
                    theirs=("attention_bias", "sliding_window"),
                    reason="transformers' NemotronH attention reads neither: it has no biases and attends to every "
                    "earlier token",
                ),
            ),
        ),
    )
