"""Mixtral's MoE section (`block_sparse_moe`): softmax routing, always renormalized, no shared experts."""

from __future__ import annotations

from blockzoo.api import (
    Constant,
    Ignored,
    Rename,
    Section,
    format_activation,
)
from blockzoo_moe.config import MoEMLPConfig
from blockzoo_moe.huggingface.common_mappings import NO_BIASES, SOFTMAX_ROUTER, TRAINING_ONLY, _weights, routing

MIXTRAL = Section(
    config_class=MoEMLPConfig,
    name="block_sparse_moe",
    config=(
        Rename("experts", "num_local_experts"),
        Rename("experts_per_token", "num_experts_per_tok"),
        Constant("shared_experts", 0),
        Constant("shared_expert_gate", None),
        Constant("shared_intermediate_size", None),
        Rename("intermediate_size", "intermediate_size"),
        Constant("gated", True),
        format_activation("hidden_act"),
        NO_BIASES,
        routing(None),
        *SOFTMAX_ROUTER,
        Rename("auxiliary_loss_coefficient", "router_aux_loss_coef", default=0.001),
        # transformers also jitters the experts' input, blockzoo only the router's: training only either way.
        Rename("router_jitter", "router_jitter_noise", default=0.0),
        Ignored(theirs=("output_router_logits",), reason="an output option of transformers"),
        TRAINING_ONLY,
    ),
    weights=_weights(
        {
            "router": "gate.weight",
            "gate": "experts.{}.w1.weight",
            "up": "experts.{}.w3.weight",
            "down": "experts.{}.w2.weight",
        }
    ),
)
