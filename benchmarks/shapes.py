"""The benchmarked shapes, built alike by blockzoo and by each peer's own library, and the maps that copy our weights
into a peer (so a peer computes the same model: the suites compare step-0 losses, the tests compare outputs).

Peer libraries are imported inside the functions that need them: a missing one only costs its own contender.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# -- Llama -------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_size: int
    ffn: int
    vocab: int
    theta: float = 10000.0
    epsilon: float = 1e-5


# Llama-3.2-1B's shape (tied embeddings): 1.236B parameters.
LLAMA_1B = LlamaShape(hidden=2048, layers=16, heads=32, kv_heads=8, head_size=64, ffn=8192, vocab=128256)
LLAMA_TINY = LlamaShape(hidden=64, layers=2, heads=4, kv_heads=2, head_size=16, ffn=128, vocab=256)


def llama_model(shape: LlamaShape) -> dict[str, Any]:
    """Our model config (the `model:` section) of a tied Llama."""
    mixer = {
        "type": "attention",
        "heads": shape.heads,
        "head_groups": shape.kv_heads,
        "head_size": shape.head_size,
        "rotary": {"type": "default", "theta": shape.theta},
    }
    return {
        "hidden_size": shape.hidden,
        "tied_embedding_weight": True,
        "embeddings": {"vocab_size": shape.vocab},
        "decoder": {
            "num_blocks": shape.layers,
            "block": {
                "mixer": mixer,
                "mlp": {"type": "mlp", "intermediate_size": shape.ffn, "gated": True, "activation": "silu"},
                "normalization": {"type": "rms_norm", "epsilon": shape.epsilon},
            },
        },
    }


def transformers_llama_config(shape: LlamaShape, length: int):
    """transformers' `LlamaConfig` of the same model (no dropout, sdpa attention chosen when it is built)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_size,
        vocab_size=shape.vocab,
        tie_word_embeddings=True,
        max_position_embeddings=max(length, 2048),
        rms_norm_eps=shape.epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": shape.theta},
        hidden_act="silu",
        attention_dropout=0.0,
    )


def llama_flops_per_token(shape: LlamaShape, parameters: int, length: int) -> float:
    """Training FLOPs per token, torchtitan's rule (anchors §6): 6·N (tied embedding counted) plus the attention
    scores and values, 12·layers·heads·head_size·length (no causal discount)."""
    return 6 * parameters + 12 * shape.layers * shape.heads * shape.head_size * length


def llama_to_transformers(weights: Mapping[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """Our Llama's parameters (`named_parameters()` names) as transformers' `LlamaForCausalLM` state dict."""
    theirs: dict[str, torch.Tensor] = {}
    remaining = dict(weights)

    def take(name: str) -> torch.Tensor:
        return remaining.pop(name)

    embedding = take("embeddings.word_embeddings")
    theirs["model.embed_tokens.weight"] = embedding
    theirs["lm_head.weight"] = remaining.pop("head.output_weight", embedding)
    theirs["model.norm.weight"] = take("head.normalization.weight")
    for index in range(layers):
        ours, layer = f"decoder.{index}", f"model.layers.{index}"
        key, value = take(f"{ours}.mixer.key_value.weight").chunk(2)
        gate, up = take(f"{ours}.mlp.gate_up.weight").chunk(2)
        theirs |= {
            f"{layer}.self_attn.q_proj.weight": take(f"{ours}.mixer.query.weight"),
            f"{layer}.self_attn.k_proj.weight": key,
            f"{layer}.self_attn.v_proj.weight": value,
            f"{layer}.self_attn.o_proj.weight": take(f"{ours}.mixer.dense.weight"),
            f"{layer}.mlp.gate_proj.weight": gate,
            f"{layer}.mlp.up_proj.weight": up,
            f"{layer}.mlp.down_proj.weight": take(f"{ours}.mlp.down.weight"),
            f"{layer}.input_layernorm.weight": take(f"{ours}.norm_1.weight"),
            f"{layer}.post_attention_layernorm.weight": take(f"{ours}.norm_2.weight"),
        }
    _check_all_mapped(remaining)
    return theirs


# -- Mamba 2 -----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mamba2Shape:
    hidden: int
    layers: int
    state: int
    head_size: int
    expand: int
    vocab: int
    groups: int = 1
    chunk: int = 256
    epsilon: float = 1e-5

    @property
    def heads(self) -> int:
        return self.expand * self.hidden // self.head_size


# mamba2-1.3b's shape (no MLP, tied embeddings): 1.34B parameters.
MAMBA2_1B = Mamba2Shape(hidden=2048, layers=48, state=128, head_size=64, expand=2, vocab=50288)
MAMBA2_TINY = Mamba2Shape(hidden=64, layers=2, state=16, head_size=16, expand=2, vocab=256, chunk=16)


def mamba2_mixer(shape: Mamba2Shape) -> dict[str, Any]:
    return {
        "type": "mamba_2",
        "heads": shape.heads,
        "head_size": shape.head_size,
        "groups": shape.groups,
        "state_size": shape.state,
        "chunk_size": shape.chunk,
    }


def mamba2_model(shape: Mamba2Shape) -> dict[str, Any]:
    """Our model config of a Mamba 2 LM: blocks of norm → mamba_2 → residual, no MLP."""
    return {
        "hidden_size": shape.hidden,
        "tied_embedding_weight": True,
        "embeddings": {"vocab_size": shape.vocab},
        "decoder": {
            "num_blocks": shape.layers,
            "block": {
                "mixer": mamba2_mixer(shape),
                "mlp": {"type": "none"},
                "normalization": {"type": "rms_norm", "epsilon": shape.epsilon},
            },
        },
    }


def mamba_ssm_layer_options(shape: Mamba2Shape) -> dict[str, Any]:
    """mamba_ssm `Mamba2` options of our mixer. `use_mem_eff_path=False`: its fused path needs the compiled
    causal-conv1d, which cannot be built on the GPU machine; the other path runs nn.Conv1d (cuDNN)."""
    return {
        "d_state": shape.state,
        "headdim": shape.head_size,
        "expand": shape.expand,
        "ngroups": shape.groups,
        "chunk_size": shape.chunk,
        "use_mem_eff_path": False,
    }


def mamba_ssm_config(shape: Mamba2Shape):
    """mamba_ssm's `MambaConfig` of the same LM, its defaults otherwise (RMSNorm, residual in fp32, the fused Triton
    add+norm, tied embeddings). Import mamba_ssm through `blockzoo_ssm.import_mamba_ssm` first."""
    from mamba_ssm.models.config_mamba import MambaConfig

    return MambaConfig(
        d_model=shape.hidden,
        d_intermediate=0,
        n_layer=shape.layers,
        vocab_size=shape.vocab,
        ssm_cfg={"layer": "Mamba2", **mamba_ssm_layer_options(shape)},
        tie_embeddings=True,
    )


def mamba2_flops_per_token(parameters: int) -> float:
    """6·N (anchors §6; the scan's own work, about 4% more at this shape, is not counted)."""
    return 6 * parameters


def mamba2_mixer_to_mamba_ssm(weights: Mapping[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """Our mamba_2 mixer's parameters (names after `prefix`) as mamba_ssm `Mamba2`'s state dict."""
    return {
        "in_proj.weight": weights[f"{prefix}in_proj.weight"],
        "conv1d.weight": weights[f"{prefix}convolution.weight"].unsqueeze(1),
        "conv1d.bias": weights[f"{prefix}convolution.bias"],
        "dt_bias": weights[f"{prefix}dt_bias"],
        "A_log": weights[f"{prefix}a_log"],
        "D": weights[f"{prefix}d"],
        "norm.weight": weights[f"{prefix}normalization.weight"],
        "out_proj.weight": weights[f"{prefix}out_proj.weight"],
    }


def mamba2_to_mamba_ssm(weights: Mapping[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """Our Mamba 2 LM's parameters as mamba_ssm `MambaLMHeadModel`'s state dict."""
    remaining = dict(weights)
    embedding = remaining.pop("embeddings.word_embeddings")
    theirs = {
        "backbone.embedding.weight": embedding,
        "lm_head.weight": remaining.pop("head.output_weight", embedding),
        "backbone.norm_f.weight": remaining.pop("head.normalization.weight"),
    }
    for index in range(layers):
        prefix = f"decoder.{index}.mixer."
        mixer = mamba2_mixer_to_mamba_ssm(remaining, prefix)
        theirs |= {f"backbone.layers.{index}.mixer.{name}": tensor for name, tensor in mixer.items()}
        theirs[f"backbone.layers.{index}.norm.weight"] = remaining.pop(f"decoder.{index}.norm_1.weight")
        for name in [name for name in remaining if name.startswith(prefix)]:
            del remaining[name]
    _check_all_mapped(remaining)
    return theirs


# -- MoE layers --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEShape:
    tokens: int
    hidden: int
    ffn: int
    experts: int
    top_k: int
    family: str  # the transformers block with this routing: "mixtral" or "qwen3_moe"


MIXTRAL = MoEShape(tokens=8192, hidden=4096, ffn=14336, experts=8, top_k=2, family="mixtral")
QWEN3_MOE = MoEShape(tokens=8192, hidden=2048, ffn=768, experts=128, top_k=8, family="qwen3_moe")
MOE_TINY = MoEShape(tokens=64, hidden=32, ffn=16, experts=4, top_k=2, family="mixtral")


def moe_layer(shape: MoEShape) -> dict[str, Any]:
    """Our MLP config of the same layer: Mixtral's and Qwen3-MoE's routing is a softmax over all experts, the top k,
    renormalized (Qwen3-30B-A3B sets norm_topk_prob); no auxiliary loss inside the layer, as in transformers'
    block (their model adds it)."""
    return {
        "type": "moe",
        "experts": shape.experts,
        "experts_per_token": shape.top_k,
        "intermediate_size": shape.ffn,
        "gated": True,
        "activation": "silu",
        "routing": "softmax_top_k",
        "norm_topk_prob": True,
        "auxiliary_loss_coefficient": 0.0,
    }


def transformers_moe_config(shape: MoEShape, experts_implementation: str | None = None):
    """transformers' config of the block (`experts_implementation`: eager, grouped_mm, batched_mm...)."""
    if shape.family == "mixtral":
        from transformers import MixtralConfig

        config = MixtralConfig(
            hidden_size=shape.hidden,
            intermediate_size=shape.ffn,
            num_local_experts=shape.experts,
            num_experts_per_tok=shape.top_k,
            num_hidden_layers=1,
            router_jitter_noise=0.0,
        )
    elif shape.family == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        config = Qwen3MoeConfig(
            hidden_size=shape.hidden,
            moe_intermediate_size=shape.ffn,
            num_experts=shape.experts,
            num_experts_per_tok=shape.top_k,
            norm_topk_prob=True,
            num_hidden_layers=1,
        )
    else:
        raise ValueError(f"unknown MoE family {shape.family!r} (mixtral or qwen3_moe)")
    if experts_implementation is not None:
        config._experts_implementation = experts_implementation
    return config


def transformers_moe_block(shape: MoEShape, experts_implementation: str | None = None) -> nn.Module:
    """transformers' sparse-MoE block of the shape (Mixtral's or Qwen3-MoE's), built where torch's default device is
    (e.g. inside `with torch.device("meta")`)."""
    config = transformers_moe_config(shape, experts_implementation)
    if shape.family == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
    return Block(config)


def default_experts_implementation(shape: MoEShape) -> str | None:
    """The experts implementation transformers gives a model of this family when it builds one (what
    `from_pretrained` uses unless told otherwise): a one-layer model made on the meta device, asked."""
    config = transformers_moe_config(shape)
    config.vocab_size = 128
    if shape.family == "mixtral":
        from transformers import MixtralForCausalLM as Model
    else:
        from transformers import Qwen3MoeForCausalLM as Model
    with torch.device("meta"):
        model = Model(config)
    return model.config._experts_implementation


def moe_layer_flops(shape: MoEShape) -> float:
    """Forward + backward FLOPs of the layer on its active experts: the router and, per routed token, the gate, up and
    down products; backward twice the forward."""
    forward = 2 * shape.tokens * shape.hidden * shape.experts + 2 * shape.tokens * shape.top_k * 3 * shape.hidden * (
        shape.ffn
    )
    return 3 * forward


def moe_to_transformers(weights: Mapping[str, torch.Tensor], shape: MoEShape) -> dict[str, torch.Tensor]:
    """Our MoE layer's parameters (`router`, `gate_up`: [gate of every expert ‖ up of every expert] × hidden, `down`:
    (expert, intermediate) × hidden) as transformers' block: `gate.weight`, `experts.gate_up_proj` [experts,
    2·ffn, hidden] (gate then up per expert), `experts.down_proj` [experts, hidden, ffn]."""
    remaining = dict(weights)
    gate_up = remaining.pop("gate_up.weight").view(2, shape.experts, shape.ffn, shape.hidden)
    down = remaining.pop("down.weight").view(shape.experts, shape.ffn, shape.hidden)
    theirs = {
        "gate.weight": remaining.pop("router.weight"),
        "experts.gate_up_proj": torch.cat([gate_up[0], gate_up[1]], dim=1),
        "experts.down_proj": down.transpose(1, 2).contiguous(),
    }
    _check_all_mapped(remaining)
    return theirs


# -- shared ------------------------------------------------------------------------------------------------------------


def parameter_count(module: nn.Module) -> int:
    """Parameters of `module`, a tied one counted once."""
    return sum(parameter.numel() for parameter in unique_parameters(module).values())


def unique_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """`named_parameters()` (a tied parameter once, under its first name)."""
    return dict(module.named_parameters())


def load_into(module: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy `weights` into `module`'s state; every key on both sides must match (a tied weight may be given under
    each of its names)."""
    missing, unexpected = module.load_state_dict(dict(weights), strict=False)
    if missing or unexpected:
        raise ValueError(f"weights do not match {type(module).__name__}: missing {missing}, unexpected {unexpected}")


def _check_all_mapped(remaining: Mapping[str, Any]) -> None:
    if remaining:
        raise ValueError(f"parameters of ours the map does not know: {sorted(remaining)}")


def our_model(model):
    """Our LanguageModel of a `model:` config (a mapping or a ModelConfig), allocated but not initialized (for
    counting: no page is touched)."""
    from blockzoo.config import structure
    from blockzoo.distributed.config import DistributedConfig
    from blockzoo.distributed.runtime import Distributed
    from blockzoo.layers.parameter import uninitialized
    from blockzoo.model.config import ModelConfig
    from blockzoo.model.language_model import LanguageModel

    distributed = Distributed(DistributedConfig(backend="gloo"), world_size=1, rank=0, local_rank=0)
    config = model if isinstance(model, ModelConfig) else structure(dict(model), ModelConfig, root="model")
    with uninitialized():
        return LanguageModel(config, distributed)


def our_layer(config: Mapping[str, Any], *, kind: str, hidden: int, device: str, initialize: bool = True):
    """Our mixer (`kind` "mixer") or MLP ("mlp") of `config` alone, named `layer`, on `device` (`cpu`: gloo, `cuda`:
    nccl), compute dtype bf16 on CUDA."""
    from blockzoo.config import structure
    from blockzoo.distributed.config import DistributedConfig
    from blockzoo.distributed.runtime import Distributed
    from blockzoo.layers.config import MixerConfig, MLPConfig
    from blockzoo.layers.dims import TensorDim
    from blockzoo.layers.parameter import uninitialized
    from blockzoo.model.block import build_part

    backend, dtype = ("nccl", "bf16") if device == "cuda" else ("gloo", "fp32")
    distributed = Distributed(
        DistributedConfig(seed=1, backend=backend, compute_dtype=dtype), world_size=1, rank=0, local_rank=0
    )
    layer_config = structure(dict(config), MixerConfig if kind == "mixer" else MLPConfig)
    with uninitialized(not initialize):
        return build_part(
            layer_config, name="layer", hidden_dim=TensorDim("hidden", hidden), distributed=distributed, lr_scale=1.0
        )
