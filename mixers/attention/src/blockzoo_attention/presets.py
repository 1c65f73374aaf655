"""The dense transformers this plugin ships as presets (`blockzoo models`): Llama 3.1/3.2, Qwen3, Mistral.

Each is the architecture part of the model's published config.json (the page named in `source`), read through its
Hugging Face format, so the checks compare it with transformers; the keys left out (token ids, dtype, generation
settings) do not change the architecture. The proxies are ours: the same family, sized for one GPU.
Torch-free.
"""

from __future__ import annotations

from blockzoo.api import Preset

REQUIRES = ("blockzoo-attention", "blockzoo-mlp", "blockzoo-huggingface")
DEFAULTS_TAKEN = (
    "Initialization, learning-rate scales and weight decay are blockzoo's defaults (the config.json has only "
    "initializer_range, not read)."
)

_LLAMA_3 = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "vocab_size": 128256,
}
_LLAMA_3_ROPE = {"high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}

LLAMA_3_2_1B = {
    **_LLAMA_3,
    "head_dim": 64,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "rope_scaling": {"factor": 32.0, **_LLAMA_3_ROPE, "rope_type": "llama3"},
    "tie_word_embeddings": True,
}
LLAMA_3_2_3B = {
    **_LLAMA_3,
    "head_dim": 128,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_attention_heads": 24,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rope_scaling": {"factor": 32.0, **_LLAMA_3_ROPE, "rope_type": "llama3"},
    "tie_word_embeddings": True,
}
LLAMA_3_1_8B = {
    **_LLAMA_3,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rope_scaling": {"factor": 8.0, **_LLAMA_3_ROPE, "rope_type": "llama3"},
    "tie_word_embeddings": False,
}

_QWEN_3 = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN_3_0_6B = {
    **_QWEN_3,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "max_window_layers": 28,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "tie_word_embeddings": True,
}
QWEN_3_1_7B = {
    **_QWEN_3,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_window_layers": 28,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "tie_word_embeddings": True,
}
QWEN_3_4B = {
    **_QWEN_3,
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "max_window_layers": 36,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "tie_word_embeddings": True,
}
QWEN_3_8B = {
    **_QWEN_3,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "max_window_layers": 36,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
}

MISTRAL_7B = {
    "model_type": "mistral",
    "architectures": ["MistralForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "vocab_size": 32000,
}

PROXY_NOTE = "Ours, not a published model: the family's architecture at a width and depth for one GPU. "

# Stored copies of the published values (`checked_against`): where each was read, and what it confirms. Every
# architecture key of each preset agrees with them.
LLM_PROF = (
    "github.com/citsjtu2020/LLM-Prof sglang/Model_Config.md@8434c8d1 (the config.json of {}, verbatim: every "
    "architecture key)"
)
TORCHTUNE_QWEN3 = (
    "github.com/pytorch/torchtune torchtune/models/qwen3/_model_builders.py@010412e0 (builders 'from "
    "https://huggingface.co/Qwen/Qwen3-{}': layers, heads, KV heads, width, MLP width, vocabulary, 40960 positions, "
    "RoPE base 1e6, eps 1e-6, tying)"
)
STORED = {
    "llama3_2_1b": (
        "github.com/kevinstephano/thunder_model_blocks hf_llama/llama_config.py (the config.json of "
        "meta-llama/Llama-3.2-1B-Instruct, the same architecture: every architecture key)",
        "github.com/Anthony-Lionetti/PyTorch-nn-Tinkering llama_play/configs.py (llama_3_2_1b: the config.json)",
    ),
    "llama3_2_3b": (
        LLM_PROF.format("Llama-3.2-3B"),
        "github.com/LocalResearchGroup/llm-foundry llmfoundry/models/llama/config.py (the meta-llama/Llama-3.2-3B "
        "config: width, heads, KV heads, layers, MLP width, eps, vocabulary, positions, RoPE base, tying)",
    ),
    "llama3_1_8b": (
        LLM_PROF.format("Llama-3.1-8B"),
        "github.com/zyzshishui/slime scripts/models/llama3.1-8B.sh (Megatron arguments: layers, width, FFN, heads, "
        "8 query groups, 131072 positions, eps, RoPE base 500000, vocabulary, RoPE scaling factor 8, untied)",
    ),
    "qwen3_0_6b": (
        TORCHTUNE_QWEN3.format("0.6B"),
        "github.com/Joinn99/GR config/modified_qwen3.py (Qwen/Qwen3-0.6B: head_dim 128, q/k norms, no biases)",
    ),
    "qwen3_1_7b": (TORCHTUNE_QWEN3.format("1.7B"),),
    "qwen3_4b": (LLM_PROF.format("Qwen3-4B"), TORCHTUNE_QWEN3.format("4B")),
    "qwen3_8b": (LLM_PROF.format("Qwen3-8B"), TORCHTUNE_QWEN3.format("8B")),
    "mistral_7b": (
        "a printout of transformers' MistralConfig loaded from mistralai/Mistral-7B-v0.1 (transformers 4.37.2: "
        "every architecture key; in public notes on Mistral and Mixtral, found by exact-string search)",
        "transformers 5.25 models/mistral/configuration_mistral.py (defaults documented as "
        "mistralai/Mistral-7B-v0.1: widths, heads, KV heads, vocabulary, sliding_window 4096)",
        "github.com/sumitdotml/transformers mistral-7b-v0.1/README.md (dim, layers, head_dim, hidden_dim, heads, "
        "KV heads, window 4096, vocabulary)",
    ),
}


def _published(name, family, repository, config, parameters, published, notes=""):
    notes = " ".join(filter(None, (notes, DEFAULTS_TAKEN)))
    fields = {"requires": REQUIRES, "notes": notes, "checked_against": STORED[name]}
    return Preset.published(family, repository, config, parameters, published, **fields)


def _proxy(family, base_name, base, parameters, **changes):
    notes = PROXY_NOTE + DEFAULTS_TAKEN
    return Preset.proxy(family, base_name, base, parameters, changes=changes, requires=REQUIRES, notes=notes)


def presets() -> dict[str, Preset]:
    return {
        "llama3_2_1b": _published(
            "llama3_2_1b", "Llama 3", "meta-llama/Llama-3.2-1B", LLAMA_3_2_1B, 1_235_814_400, "1.23B"
        ),
        "llama3_2_3b": _published(
            "llama3_2_3b", "Llama 3", "meta-llama/Llama-3.2-3B", LLAMA_3_2_3B, 3_212_749_824, "3.21B"
        ),
        "llama3_1_8b": _published(
            "llama3_1_8b", "Llama 3", "meta-llama/Llama-3.1-8B", LLAMA_3_1_8B, 8_030_261_248, "8B"
        ),
        "qwen3_0_6b": _published("qwen3_0_6b", "Qwen3", "Qwen/Qwen3-0.6B", QWEN_3_0_6B, 596_049_920, "0.6B"),
        "qwen3_1_7b": _published("qwen3_1_7b", "Qwen3", "Qwen/Qwen3-1.7B", QWEN_3_1_7B, 1_720_574_976, "1.7B"),
        "qwen3_4b": _published("qwen3_4b", "Qwen3", "Qwen/Qwen3-4B", QWEN_3_4B, 4_022_468_096, "4.0B"),
        "qwen3_8b": _published("qwen3_8b", "Qwen3", "Qwen/Qwen3-8B", QWEN_3_8B, 8_190_735_360, "8.2B"),
        "mistral_7b": _published(
            "mistral_7b",
            "Mistral",
            "mistralai/Mistral-7B-v0.1",
            MISTRAL_7B,
            7_241_732_096,
            "7.3B",
            notes="Attention in a sliding window of 4096 tokens, as published.",
        ),
        "llama3_proxy_200m": _proxy(
            "Llama 3",
            "llama3_2_1b",
            LLAMA_3_2_1B,
            202_328_832,
            hidden_size=768,
            intermediate_size=3072,
            num_attention_heads=12,
            num_key_value_heads=4,
            num_hidden_layers=12,
        ),
        "mistral_proxy_150m": _proxy(
            "Mistral",
            "mistral_7b",
            MISTRAL_7B,
            152_980_224,
            hidden_size=768,
            intermediate_size=3072,
            num_attention_heads=12,
            num_key_value_heads=4,
            num_hidden_layers=12,
            sliding_window=1024,
        ),
        "qwen3_proxy_125m": _proxy(
            "Qwen3",
            "qwen3_0_6b",
            QWEN_3_0_6B,
            124_993_024,
            hidden_size=512,
            intermediate_size=1536,
            num_attention_heads=8,
            num_key_value_heads=4,
            num_hidden_layers=12,
        ),
    }


def register_presets(register) -> None:
    for name, preset in presets().items():
        register(name, preset)
