"""torchtitan as a peer: its Llama 3 and its MoE (grouped GEMMs) at our benchmarked shapes, built from torchtitan's
own config classes and helpers, our initial weights copied in; its compile, activation checkpointing and Float8
conversion applied the way its `parallelize_llama` and `Float8LinearConverter` apply them.

Written against torchtitan 0.3.0 and torchao 0.18.0 (benchmarks/make_wheels.sh brings both to the GPU machine); runs on
torch 2.11 (the GPU machine's) and later, see `_placeholder_for_parallelization` and `_block_masks_of_an_older_torch`.
Every torchtitan import is inside a function: without it the peer is absent, nothing else.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
from collections.abc import Mapping

import torch
from torch import nn

from benchmarks.harness import Absent
from benchmarks.shapes import LlamaShape, MoEShape, _check_all_mapped, llama_to_transformers

FLOAT8_RECIPES = ("tensorwise", "rowwise")


PARALLELIZATION_MODULE = "torchtitan.models.llama3.parallelize"


def _placeholder_for_parallelization() -> None:
    """torchtitan 0.3.0's `llama3` package imports its FSDP parallelization, which imports
    `torch.distributed.fsdp.DataParallelMeshDims` (torch >= 2.12). The peer runs in one process and never
    parallelizes, so on an older torch (the GPU machine's 2.11) that one module is replaced by a placeholder that
    refuses to be called; the model, compile, activation checkpointing, loss and float8 code it uses import as they
    are. With a torch that has the name, nothing is replaced."""
    import torch.distributed.fsdp as fsdp

    if hasattr(fsdp, "DataParallelMeshDims") or PARALLELIZATION_MODULE in sys.modules:
        return

    def parallelize_llama(*args, **kwargs):
        raise RuntimeError(f"torchtitan's parallelization needs torch >= 2.12 (this is {torch.__version__})")

    placeholder = types.ModuleType(PARALLELIZATION_MODULE)
    placeholder.parallelize_llama = parallelize_llama
    sys.modules[PARALLELIZATION_MODULE] = placeholder


@functools.cache  # once per process: each call would wrap (and compile) anew
def _block_masks_of_an_older_torch() -> None:
    """torchtitan 0.3.0 asks FlexAttention's `create_block_mask` to `separate_full_blocks` (a parameter of torch >=
    2.12) unless it runs batch-invariant. torch 2.11's `create_block_mask` has no such parameter and always separates
    the fully unmasked blocks, so there the argument is dropped when true (what the peer asks) and refused when
    false; the masks are the same. With a torch that has the parameter, nothing is replaced."""
    import inspect

    import torchtitan.models.common.attention as attention
    from torch.nn.attention.flex_attention import create_block_mask

    if "separate_full_blocks" in inspect.signature(create_block_mask).parameters:
        return
    compiled = torch.compile(create_block_mask)

    def create_block_mask_separating_full_blocks(*args, separate_full_blocks: bool = True, **kwargs):
        if not separate_full_blocks:
            raise RuntimeError(f"torch {torch.__version__} always separates full blocks in FlexAttention's masks")
        return compiled(*args, **kwargs)

    attention._compiled_create_block_mask = create_block_mask_separating_full_blocks


def _import_torchtitan():
    try:
        _placeholder_for_parallelization()
        import torchtitan.models.llama3 as llama3
    except ImportError as error:
        raise Absent(f"torchtitan does not import: {error} (benchmarks/make_wheels.sh lists what it needs)") from None
    _block_masks_of_an_older_torch()
    return llama3


def llama_config(shape: LlamaShape, length: int, *, attention: str, float8: str | None = None, emulate: bool = False):
    """torchtitan's `Llama3Model.Config` of our shape: its Llama 3 layers (`_build_llama3_layers`: fused QKV, its
    initializations), complex rotary with our theta and no frequency scaling, tied embeddings. `attention`: `flex`
    (torchtitan's default for Llama 3: block-causal FlexAttention) or `sdpa` (its ScaledDotProductAttention, causal;
    FlexAttention has no backward on the CPU). `float8`: a torchao recipe applied by torchtitan's
    `Float8LinearConverter` to every linear with dims divisible by 16 (its own filter)."""
    llama3 = _import_torchtitan()
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention

    rope = ComplexRoPE.Config(dim=shape.head_size, max_seq_len=length, theta=shape.theta, scaling="none")
    layers = llama3._build_llama3_layers(
        n_layers=shape.layers,
        dim=shape.hidden,
        n_heads=shape.heads,
        n_kv_heads=shape.kv_heads,
        hidden_dim=shape.ffn,
        rope=rope,
        attn_backend="flex",
    )
    if attention == "sdpa":
        for layer in layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    elif attention != "flex":
        raise ValueError(f"attention is flex or sdpa, got {attention!r}")
    for layer in layers:
        layer.attention_norm = dataclasses.replace(layer.attention_norm, eps=shape.epsilon)
        layer.ffn_norm = dataclasses.replace(layer.ffn_norm, eps=shape.epsilon)
    config = llama3.Llama3Model.Config(
        dim=shape.hidden,
        vocab_size=shape.vocab,
        enable_weight_tying=True,
        tok_embeddings=Embedding.Config(
            num_embeddings=shape.vocab, embedding_dim=shape.hidden, param_init=llama3._EMBEDDING_SKIP_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=shape.hidden, eps=shape.epsilon, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(
            in_features=shape.hidden, out_features=shape.vocab, param_init=llama3._output_linear_init(shape.hidden)
        ),
        layers=layers,
    )
    if float8 is not None:
        config = float8_converter(float8, emulate=emulate).convert(config)
    return config


def float8_converter(recipe: str, *, emulate: bool):
    """torchtitan's `Float8LinearConverter` with a torchao recipe. torchtitan 0.3.0's config offers `rowwise` (and
    `rowwise_with_gw_hp`) only; the recipe name goes to torchao's `Float8LinearConfig.from_recipe_name` unchanged,
    so `tensorwise` (the recipe of torchtitan's published Float8 figures) is taken as it is. `emulate`: torchao's
    emulation (the CPU, no compile)."""
    if recipe not in FLOAT8_RECIPES:
        raise ValueError(f"float8 recipe is one of {', '.join(FLOAT8_RECIPES)}, got {recipe!r}")
    _import_torchtitan()
    try:
        from torchtitan.components.quantization.float8 import Float8LinearConverter
    except ImportError as error:
        raise Absent(f"torchtitan's float8 converter does not import: {error}") from None
    try:
        converter = Float8LinearConverter(Float8LinearConverter.Config(recipe_name=recipe, emulate=emulate))
    except (ImportError, ValueError) as error:  # torchao absent; no FP8 tensor cores
        raise Absent(f"torchtitan refuses float8 here: {error}") from None
    if emulate:  # the converter's emulation replaces the recipe by torchao's default (tensorwise): keep ours
        from torchao.float8 import Float8LinearConfig

        converter.torchao_config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    return converter


def build_llama(config, device: torch.device) -> nn.Module:
    """The model of a `Llama3Model.Config` on `device`, fp32 parameters, buffers (rotary cache) initialized."""
    with torch.device(device):
        model = config.build()
    model.init_states(buffer_device=device)
    return model


def apply_policies(model: nn.Module, *, compile: bool, checkpointing: str | None) -> None:
    """torchtitan's activation checkpointing (`full` or `selective`: its `FullAC` / `SelectiveAC`) then its
    per-block compile (`apply_compile`), in the order `parallelize_llama` applies them, on one device."""
    if checkpointing is not None:
        from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

        policies = {"full": FullAC, "selective": SelectiveAC}
        if checkpointing not in policies:
            raise ValueError(f"torchtitan's checkpointing is full or selective, got {checkpointing!r}")
        policy = policies[checkpointing]
        policy(policy.Config()).apply(model)
    if compile:
        from torchtitan.config import CompileConfig
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed.compile import apply_compile

        single = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
        apply_compile(model, compile_config=CompileConfig(enable=True, components=["model"]), parallel_dims=single)


def llama_logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of `tokens` [rows, length], one document per row (the positions restart at each row), with the
    attention masks torchtitan's decoder makes for its attention (none for sdpa, which is causal)."""
    rows, length = tokens.shape
    positions = torch.arange(length, device=tokens.device).expand(rows, length)
    uses_masks = any(type(module).__name__ == "FlexAttention" for module in model.modules())
    masks = model.get_attention_masks(positions) if uses_masks else None
    return model(tokens, positions, masks)


def cross_entropy(*, compile: bool):
    """torchtitan's loss (`CrossEntropyLoss`: float32 cross-entropy summed over the labels that are not -100),
    compiled when the model is, as torchtitan's default compile components ("model", "loss") do."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig

    loss = CrossEntropyLoss(CrossEntropyLoss.Config(), compile_config=CompileConfig(enable=compile))

    def function(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss(logits, labels)[0]

    return function


def llama_to_torchtitan(weights: Mapping[str, torch.Tensor], shape: LlamaShape) -> dict[str, torch.Tensor]:
    """Our Llama's parameters as torchtitan's Llama 3 state dict: through transformers' names
    (`shapes.llama_to_transformers`), then `transformers_to_torchtitan`."""
    return transformers_to_torchtitan(llama_to_transformers(weights, shape.layers), shape)


def transformers_to_torchtitan(weights: Mapping[str, torch.Tensor], shape: LlamaShape) -> dict[str, torch.Tensor]:
    """transformers' `LlamaForCausalLM` state dict (tied) as torchtitan's Llama 3 state dict (its fused QKV loads
    from `wq`/`wk`/`wv`). transformers' rotary (and ours) turns the two halves of each head; torchtitan's complex
    rotary turns adjacent pairs: the query and key rows are permuted within each head, the inverse of the
    permutation of Meta's conversion script to transformers."""
    remaining = dict(weights)
    theirs = {"tok_embeddings.weight": remaining.pop("model.embed_tokens.weight")}
    theirs["lm_head.weight"] = remaining.pop("lm_head.weight", theirs["tok_embeddings.weight"])
    theirs["norm.weight"] = remaining.pop("model.norm.weight")
    for index in range(shape.layers):
        hf, layer = f"model.layers.{index}", f"layers.{index}"
        theirs |= {
            f"{layer}.attention.qkv_linear.wq.weight": pairs_adjacent(
                remaining.pop(f"{hf}.self_attn.q_proj.weight"), shape.heads
            ),
            f"{layer}.attention.qkv_linear.wk.weight": pairs_adjacent(
                remaining.pop(f"{hf}.self_attn.k_proj.weight"), shape.kv_heads
            ),
            f"{layer}.attention.qkv_linear.wv.weight": remaining.pop(f"{hf}.self_attn.v_proj.weight"),
            f"{layer}.attention.wo.weight": remaining.pop(f"{hf}.self_attn.o_proj.weight"),
            f"{layer}.feed_forward.w1.weight": remaining.pop(f"{hf}.mlp.gate_proj.weight"),
            f"{layer}.feed_forward.w3.weight": remaining.pop(f"{hf}.mlp.up_proj.weight"),
            f"{layer}.feed_forward.w2.weight": remaining.pop(f"{hf}.mlp.down_proj.weight"),
            f"{layer}.attention_norm.weight": remaining.pop(f"{hf}.input_layernorm.weight"),
            f"{layer}.ffn_norm.weight": remaining.pop(f"{hf}.post_attention_layernorm.weight"),
        }
    _check_all_mapped(remaining)
    return theirs


def pairs_adjacent(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a query/key projection from the halves layout (row i pairs with i + head_size/2) to the adjacent
    pairs layout (row 2i pairs with 2i + 1), head by head."""
    rows, columns = weight.shape
    return weight.view(heads, 2, rows // heads // 2, columns).transpose(1, 2).reshape(rows, columns)


def load(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy `weights` into a torchtitan model: every parameter written (its buffers are computed, not loaded)."""
    missing, unexpected = model.load_state_dict(dict(weights), strict=False)
    missing = [name for name in missing if name not in dict(model.named_buffers())]
    if missing or unexpected:
        raise ValueError(f"weights do not match torchtitan's model: missing {missing}, unexpected {unexpected}")


# -- MoE ---------------------------------------------------------------------------------------------------------------


def moe_layer(shape: MoEShape, device: torch.device) -> nn.Module:
    """torchtitan's MoE of the shape as its Qwen3 MoE models configure it (softmax router over all experts, top k
    renormalized, no shared expert, the local token dispatcher of one device, grouped GEMMs in bf16 whatever the
    parameters' dtype), fp32 parameters on `device`."""
    _import_torchtitan()
    from torchtitan.models.common.config_utils import make_moe_config, make_routed_experts_config, make_router_config

    initialization = {"weight": nn.init.zeros_, "bias": nn.init.zeros_}  # our weights are copied in
    experts_initialization = {name: nn.init.zeros_ for name in ("w1_EFD", "w2_EDF", "w3_EFD")}
    config = make_moe_config(
        num_experts=shape.experts,
        router=make_router_config(
            dim=shape.hidden,
            num_experts=shape.experts,
            gate_param_init=initialization,
            top_k=shape.top_k,
            score_func="softmax",
            route_norm=True,
        ),
        routed_experts=make_routed_experts_config(
            dim=shape.hidden,
            hidden_dim=shape.ffn,
            num_experts=shape.experts,
            top_k=shape.top_k,
            param_init=experts_initialization,
            comm_backend="standard",
        ),
    )
    with torch.device(device):
        layer = config.build()
    layer.init_states(buffer_device=device)
    return layer


def moe_to_torchtitan(weights: Mapping[str, torch.Tensor], shape: MoEShape) -> dict[str, torch.Tensor]:
    """Our MoE layer's parameters (see `shapes.moe_to_transformers`) as torchtitan's: `router.gate.weight`, the
    experts' `w1_EFD` (gate) and `w3_EFD` (up) [experts, ffn, hidden], `w2_EDF` (down) [experts, hidden, ffn]."""
    remaining = dict(weights)
    gate_up = remaining.pop("gate_up.weight").view(2, shape.experts, shape.ffn, shape.hidden)
    down = remaining.pop("down.weight").view(shape.experts, shape.ffn, shape.hidden)
    experts = "routed_experts.inner_experts"
    theirs = {
        "router.gate.weight": remaining.pop("router.weight"),
        f"{experts}.w1_EFD": gate_up[0].contiguous(),
        f"{experts}.w3_EFD": gate_up[1].contiguous(),
        f"{experts}.w2_EDF": down.transpose(1, 2).contiguous(),
    }
    _check_all_mapped(remaining)
    return theirs
