"""How the mixture of experts is written in the Hugging Face formats (converter sections, see `blockzoo.conversion`).

On disk every format keeps one tensor per expert and projection (transformers 5 fuses them in memory only), so
the files load in transformers 4.x and 5.x: Mixtral `block_sparse_moe.experts.E.{w1,w3,w2}` (gate, up, down),
Qwen-MoE `mlp.experts.E.{gate,up,down}_proj`, the router `gate`. blockzoo holds the experts of a projection as one
tensor, rows expert-major (gate‖up: every expert's gate, then every expert's up; down transposed). Torch-free.

The mappings the families share are in `common_mappings`, each family's section in its own module; this one
registers them all (`register_sections`).
"""

from __future__ import annotations

from collections.abc import Callable

from blockzoo.api import Section
from blockzoo_moe.huggingface.common_mappings import NO_BIASES, SOFTMAX_ROUTER, TRAINING_ONLY, routing
from blockzoo_moe.huggingface.deepseek_v3 import DEEPSEEK_V3
from blockzoo_moe.huggingface.granite import GRANITE
from blockzoo_moe.huggingface.jamba import JAMBA
from blockzoo_moe.huggingface.mixtral import MIXTRAL
from blockzoo_moe.huggingface.nemotron_h import NEMOTRON_H
from blockzoo_moe.huggingface.qwen import _qwen_section

__all__ = [
    "DEEPSEEK_V3",
    "GRANITE",
    "JAMBA",
    "MIXTRAL",
    "NEMOTRON_H",
    "NO_BIASES",
    "SOFTMAX_ROUTER",
    "TRAINING_ONLY",
    "register_sections",
    "routing",
]


def register_sections(register: Callable[[str, Section], None]) -> None:
    """The MoE section of every Hugging Face MoE format."""
    register("mixtral", MIXTRAL)
    register("qwen2_moe", _qwen_section(shared=True, experts_key="num_experts"))
    # `num_experts`: read by transformers 4.x and (through its attribute map) 5.x.
    register("qwen3_moe", _qwen_section(shared=False, experts_key="num_experts"))
    register("qwen3_next", _qwen_section(shared=True, experts_key="num_experts"))  # Qwen2-MoE's gated shared expert
    register("jamba", JAMBA)
    register("nemotron_h", NEMOTRON_H)
    register("granitemoehybrid", GRANITE)
    register("deepseek_v3", DEEPSEEK_V3)
