"""MoE layer forward+backward: ours (grouped GEMMs) against ours with one product per expert and against
transformers' Mixtral sparse-MoE block, at the same shape, in one run. Prints times, TFLOP/s on the active experts
and the ratios. Run on a GPU: `python mlps/moe/benchmarks/moe_layer.py [--tokens 8192 --hidden 4096 ...]`.

"ours, compiled pieces" (CUDA) is ours with BLOCKZOO_MOE_COMPILE=1: torch.compile of the gathers and the gated
activation.

The default shape is Mixtral 8x7B's layer (hidden 4096, ffn 14336, 8 experts, top-2) over 8192 tokens; the
fine-grained shape of Fast-LLM's kernel benchmark is `--experts 64 --ffn 1792`.
"""

from __future__ import annotations

import argparse
import os
import time
from unittest import mock

import torch

from blockzoo.config import structure
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.base import Batch
from blockzoo.layers.config import MLPConfig
from blockzoo.layers.dims import TensorDim
from blockzoo_moe.dispatch import COMPILE_VARIABLE
from blockzoo_moe.moe import MoEMLP


def time_step(step, steps: int, warmup: int, device: str) -> float:
    """Seconds per call of `step`, waiting for the device's work."""
    for _ in range(warmup):
        step()
    synchronize = torch.cuda.synchronize if device == "cuda" else lambda: None
    synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize()
    return (time.perf_counter() - start) / steps


def our_layer(arguments: argparse.Namespace) -> MoEMLP:
    config = structure(
        {
            "type": "moe",
            "experts": arguments.experts,
            "experts_per_token": arguments.top_k,
            "intermediate_size": arguments.ffn,
            "gated": True,
            "auxiliary_loss_coefficient": 0.0,
        },
        MLPConfig,
    )
    backend = "nccl" if arguments.device == "cuda" else "gloo"
    distributed = Distributed(DistributedConfig(seed=1, backend=backend), world_size=1, rank=0, local_rank=0)
    hidden_dim = TensorDim("hidden", arguments.hidden)
    return MoEMLP(config, name="moe", hidden_dim=hidden_dim, distributed=distributed, lr_scale=1.0)


def mixtral_block(arguments: argparse.Namespace, experts_implementation: str):
    """transformers' block; `experts_implementation` is `grouped_mm` (what `from_pretrained` picks where it can) or
    `eager` (a loop over the experts)."""
    try:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    except ImportError as error:
        print(f"transformers' Mixtral block unavailable ({error}); skipping it")
        return None
    config = MixtralConfig(
        hidden_size=arguments.hidden,
        intermediate_size=arguments.ffn,
        num_local_experts=arguments.experts,
        num_experts_per_tok=arguments.top_k,
    )
    config._experts_implementation = experts_implementation
    return MixtralSparseMoeBlock(config).to(arguments.device).bfloat16()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda", help="cpu: a quick smoke run of this script (tiny shapes only)")
    arguments = parser.parse_args()

    device = arguments.device
    generator = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(arguments.tokens, arguments.hidden, device=device, generator=generator).bfloat16()
    output_grad = torch.randn_like(hidden)
    lengths = [arguments.tokens]
    layer = our_layer(arguments)
    forward_flops, backward_flops = layer.flops(Batch(lengths))

    def ours_step() -> None:
        inputs = hidden.detach().requires_grad_()
        layer(inputs, Batch(lengths, device=device)).backward(output_grad)

    results = {"ours": time_step(ours_step, arguments.steps, arguments.warmup, device)}
    if device == "cuda":
        with mock.patch.dict(os.environ, {COMPILE_VARIABLE: "1"}):
            results["ours, compiled pieces"] = time_step(ours_step, arguments.steps, arguments.warmup, device)
    with mock.patch.object(MoEMLP, "uses_grouped_mm", lambda self, routed: False):
        results["ours, one product per expert"] = time_step(ours_step, arguments.steps, arguments.warmup, device)
    layer.to("meta")  # Frees its memory for the next contender.

    for experts_implementation in ("grouped_mm", "eager"):
        block = mixtral_block(arguments, experts_implementation)
        if block is None:
            break

        def mixtral_step(block=block) -> None:
            inputs = hidden.detach().view(1, *hidden.shape).requires_grad_()
            output = block(inputs)
            output = output[0] if isinstance(output, tuple) else output
            output.backward(output_grad.view_as(output))

        name = f"transformers Mixtral block, {experts_implementation}"
        results[name] = time_step(mixtral_step, arguments.steps, arguments.warmup, device)

    shape = ", ".join(
        f"{key} {value}" for key, value in vars(arguments).items() if key not in ("steps", "warmup", "device")
    )
    print(f"MoE layer forward+backward, bf16, {shape}; {(forward_flops + backward_flops) / 1e12:.2f} TFLOP per step")
    reference = results["ours"]
    for name, seconds in results.items():
        tflops = (forward_flops + backward_flops) / seconds / 1e12
        print(
            f"  {name:38s} {seconds * 1e3:9.2f} ms  {tflops:7.1f} TFLOP/s  ours is {seconds / reference:5.2f}x faster"
        )


if __name__ == "__main__":
    main()
