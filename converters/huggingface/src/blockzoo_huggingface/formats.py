"""The Hugging Face formats of the transformer architectures (the SSM and hybrid ones build on the same pieces).

Each is data: the transformers `model_type` and class, the layer layout, the model-level keys of its own. What
each mixer and MLP looks like in it comes from the sections their plugins register. Torch-free.
"""

from __future__ import annotations

from typing import Any

from blockzoo.conversion import ConversionError, Fixed
from blockzoo_huggingface.format import HuggingfaceFormat
from blockzoo_huggingface.formats_deepseek import DEEPSEEK_FORMATS
from blockzoo_huggingface.formats_falcon_h1 import FALCON_H1_FORMATS
from blockzoo_huggingface.formats_granite import GRANITE_FORMATS
from blockzoo_huggingface.formats_mamba import MAMBA_FORMATS
from blockzoo_huggingface.formats_mamba2 import MAMBA2_FORMATS
from blockzoo_huggingface.formats_qwen3_next import QWEN3_NEXT_FORMATS
from blockzoo_huggingface.layouts import SlidingWindowLayers, SparseMoELayers, Uniform
from blockzoo_huggingface.sections import transformer_model


def _qwen2_moe_legacy(config: dict[str, Any]) -> dict[str, Any]:
    # transformers 4.x's Qwen2-MoE always has q, k and v biases, and no key for them.
    if not config.pop("qkv_bias", True):
        raise ConversionError("transformers 4.x's Qwen2-MoE always has q, k and v biases; this model has none")
    return config


TRANSFORMER_FORMATS = (
    HuggingfaceFormat(
        name="llama",
        model_type="llama",
        architecture="LlamaForCausalLM",
        layout=Uniform(),
        model_section=transformer_model(extra=(Fixed("pretraining_tp", 1),)),
        description="Llama (1-3): GQA, head_dim, RoPE default / llama3 / yarn, attention and MLP biases",
    ),
    HuggingfaceFormat(
        name="mistral",
        model_type="mistral",
        architecture="MistralForCausalLM",
        layout=Uniform(),
        description="Mistral: Llama with a sliding window",
    ),
    HuggingfaceFormat(
        name="qwen2",
        model_type="qwen2",
        architecture="Qwen2ForCausalLM",
        layout=SlidingWindowLayers(),
        description="Qwen2: q, k, v biases; sliding-window layers",
    ),
    HuggingfaceFormat(
        name="qwen3",
        model_type="qwen3",
        architecture="Qwen3ForCausalLM",
        layout=SlidingWindowLayers(),
        defaults={"rms_norm_eps": 1e-6, "head_dim": 128},  # transformers' head_dim is 128 whatever the width
        description="Qwen3: q/k norms, attention biases, sliding-window layers",
    ),
    HuggingfaceFormat(
        name="mixtral",
        model_type="mixtral",
        architecture="MixtralForCausalLM",
        layout=Uniform(mlp="moe"),
        defaults={"rms_norm_eps": 1e-5},
        default_rope_theta=1e6,
        description="Mixtral: mixture of experts in every layer",
    ),
    HuggingfaceFormat(
        name="qwen2_moe",
        model_type="qwen2_moe",
        architecture="Qwen2MoeForCausalLM",
        layout=SparseMoELayers(sliding_layers=True),
        legacy=_qwen2_moe_legacy,
        description="Qwen2-MoE: gated shared experts, norm_topk_prob, dense layers (mlp_only_layers)",
    ),
    HuggingfaceFormat(
        name="qwen3_moe",
        model_type="qwen3_moe",
        architecture="Qwen3MoeForCausalLM",
        layout=SparseMoELayers(),
        description="Qwen3-MoE: q/k norms, norm_topk_prob, dense layers (mlp_only_layers)",
    ),
)

FORMATS = (
    *TRANSFORMER_FORMATS,
    *MAMBA_FORMATS,
    *MAMBA2_FORMATS,
    *QWEN3_NEXT_FORMATS,
    *GRANITE_FORMATS,
    *DEEPSEEK_FORMATS,
    *FALCON_H1_FORMATS,
)
