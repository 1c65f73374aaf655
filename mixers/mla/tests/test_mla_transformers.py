"""The MLA mixer against transformers' DeepseekV3Attention (its SDPA path, causal) with the same weights: plain and
low-rank queries, DeepSeek's interleaved rotary pairs (rope_interleave, our interleaved_rotary) and the rotate-half
ones, and YaRN with its mscale in the softmax scale."""

import math

import pytest
import torch
from mla_reference import SEED, build

from blockzoo.api import Batch

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf  # noqa: E402

HIDDEN = 16
CASES = {
    "low-rank-query-interleaved": {"q_lora_rank": 12, "rope_interleave": True},
    "plain-query-rotate-half": {"q_lora_rank": None, "rope_interleave": False},
    "yarn-mscale": {
        "q_lora_rank": 12,
        "rope_interleave": True,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 100.0,
            "factor": 4.0,
            "original_max_position_embeddings": 4,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    },
}


def hf_config(case: dict):
    data = {
        "vocab_size": 32,
        "hidden_size": HIDDEN,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 8,
        "qk_nope_head_dim": 6,
        "qk_rope_head_dim": 4,
        "v_head_dim": 5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100.0},
        "attention_bias": False,
        **case,
    }
    config = transformers.DeepseekV3Config(**data)
    config._attn_implementation = "sdpa"
    return config


def ours_for(config, rotary: dict, softmax_scale: float | None):
    return build(
        {
            "heads": config.num_attention_heads,
            "query_rank": config.q_lora_rank,
            "key_value_rank": config.kv_lora_rank,
            "nope_head_size": config.qk_nope_head_dim,
            "rotary_head_size": config.qk_rope_head_dim,
            "value_head_size": config.v_head_dim,
            "query_norm": {"epsilon": config.rms_norm_eps, "weight": {"initialization": {"type": "normal"}}},
            "key_value_norm": {"epsilon": config.rms_norm_eps, "weight": {"initialization": {"type": "normal"}}},
            "rotary": rotary,
            "interleaved_rotary": config.rope_interleave,
            "softmax_scale": softmax_scale,
        },
        hidden=HIDDEN,
    )


def copy_weights(ours, theirs, config) -> None:
    """Our (random) weights into transformers' layer: the same layout, one to one."""
    with torch.no_grad():
        query = ours.query if ours.query is not None else ours.query_up
        (theirs.q_proj if config.q_lora_rank is None else theirs.q_b_proj).weight.copy_(query.weight)
        if config.q_lora_rank is not None:
            theirs.q_a_proj.weight.copy_(ours.query_down.weight)
            theirs.q_a_layernorm.weight.copy_(ours.query_norm.weight)
        theirs.kv_a_proj_with_mqa.weight.copy_(ours.key_value_down.weight)
        theirs.kv_a_layernorm.weight.copy_(ours.key_value_norm.weight)
        theirs.kv_b_proj.weight.copy_(ours.key_value_up.weight)
        theirs.o_proj.weight.copy_(ours.dense.weight)


@pytest.mark.parametrize("case", CASES)
def test_matches_transformers_deepseek_v3_attention(case):
    config = hf_config(CASES[case])
    rope = config.rope_parameters
    if rope["rope_type"] == "yarn":
        # DeepSeek's YaRN: tables scaled by mscale/mscale_all_dim (1 here), logits by mscale_all_dim's mscale².
        mscale = 0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1.0
        rotary = {
            "type": "yarn",
            "theta": rope["rope_theta"],
            "scale_factor": rope["factor"],
            "original_context_length": rope["original_max_position_embeddings"],
            "attention_factor": 1.0,
        }
        softmax_scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5 * mscale**2
    else:
        rotary, softmax_scale = {"type": "default", "theta": rope["rope_theta"]}, None
    ours = ours_for(config, rotary, softmax_scale)
    theirs = hf.DeepseekV3Attention(config, layer_idx=0).double()
    copy_weights(ours, theirs, config)
    rotary_embedding = hf.DeepseekV3RotaryEmbedding(config)
    generator = torch.Generator().manual_seed(SEED)
    hidden = torch.randn(2, 7, HIDDEN, generator=generator, dtype=torch.float64)
    positions = torch.arange(7)[None].expand(2, -1)
    with torch.no_grad():
        cos, sin = rotary_embedding(hidden, positions)
        expected, _ = theirs(hidden, (cos.double(), sin.double()), attention_mask=None)
        output = ours(hidden.flatten(0, 1).float(), Batch([7, 7]))
    assert theirs.scaling == pytest.approx(ours.config.resolved_softmax_scale, rel=1e-12)
    torch.testing.assert_close(output.unflatten(0, (2, 7)).double(), expected, atol=1e-5, rtol=1e-5)
