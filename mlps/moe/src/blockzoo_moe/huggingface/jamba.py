"""Jamba's MoE section (`feed_forward`): softmax routing never renormalized, Qwen's expert names."""

from __future__ import annotations

from typing import Any

from blockzoo.api import (
    Computed,
    Constant,
    ConversionError,
    Ignored,
    Rename,
    Section,
    format_activation,
)
from blockzoo_moe.config import MoEMLPConfig
from blockzoo_moe.huggingface.common_mappings import (
    NO_BIASES,
    SOFTMAX_ROUTER,
    TRAINING_ONLY,
    _check_softmax,
    _normalized,
    _weights,
)
from blockzoo_moe.huggingface.qwen import _QWEN_NAMES


def _export_unnormalized(config: MoEMLPConfig) -> dict[str, Any]:
    _check_softmax(config)
    if _normalized(config):
        raise ConversionError("renormalized routing cannot be written: Jamba never renormalizes the top-k scores")
    return {}


# Jamba: softmax over all experts, top k, never renormalized; `feed_forward.router`, `experts.E.{gate,up,down}_proj`.
JAMBA = Section(
    config_class=MoEMLPConfig,
    name="feed_forward",
    config=(
        Rename("experts", "num_experts"),
        Rename("experts_per_token", "num_experts_per_tok"),
        Constant("shared_experts", 0),
        Constant("shared_expert_gate", None),
        Constant("shared_intermediate_size", None),
        Rename("intermediate_size", "intermediate_size"),
        Constant("gated", True),
        format_activation("hidden_act"),
        NO_BIASES,
        Computed(
            ("routing", "norm_topk_prob"),
            (),
            import_=lambda data: {"routing": "softmax_top_k", "norm_topk_prob": False},
            export=_export_unnormalized,
        ),
        *SOFTMAX_ROUTER,
        Rename("auxiliary_loss_coefficient", "router_aux_loss_coef", default=0.001),
        Ignored(ours=("router_jitter",), theirs=("output_router_logits",), reason="training and output options"),
        TRAINING_ONLY,
    ),
    weights=_weights({**_QWEN_NAMES, "router": "router.weight"}),
)
