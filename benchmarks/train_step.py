"""Training-step throughput of a blockzoo transformer against transformers' LlamaForCausalLM at the same shape.

Both: fp32 master weights, bf16 compute, AdamW, the same batch of `rows` documents of `length` tokens.
Prints tokens/s and MFU of each and the ratio. Run on a GPU: `python benchmarks/train_step.py`.
"""

from __future__ import annotations

import argparse
import time

import torch

import blockzoo
from blockzoo.layers.base import Batch

PEAK_TFLOPS = 989.0  # H100/H200 dense bf16


def shape(arguments: argparse.Namespace) -> dict:
    return {
        "model": {
            "hidden_size": arguments.hidden,
            "tied_embedding_weight": True,
            "embeddings": {"vocab_size": arguments.vocab},
            "decoder": {
                "num_blocks": arguments.layers,
                "block": {
                    "mixer": {
                        "type": "attention",
                        "heads": arguments.heads,
                        "head_groups": arguments.groups,
                        "head_size": arguments.hidden // arguments.heads,
                        "rotary": {"type": "default", "theta": 10000},
                    },
                    "mlp": {"type": "mlp", "intermediate_size": arguments.ffn, "gated": True, "activation": "silu"},
                    "normalization": {"type": "rms_norm", "epsilon": 1e-5},
                },
            },
        },
        "distributed": {"compute_dtype": "bf16"},
    }


def time_steps(step, steps: int, warmup: int) -> float:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def ours(arguments: argparse.Namespace, tokens: torch.Tensor) -> tuple[float, int]:
    from blockzoo.training.config import AdamWConfig
    from blockzoo.training.optimizer import AdamW

    model = blockzoo.build(shape(arguments))
    optimizer = AdamW(AdamWConfig(learning_rate=1e-4), model.parameters())
    flat, labels = tokens.reshape(-1), torch.roll(tokens, -1, 1).reshape(-1)
    batch = Batch([arguments.length] * arguments.rows, device="cuda")

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss, _ = model.loss(flat, labels, batch)
        (loss / len(flat)).backward()
        optimizer.step()

    forward, backward = model.flops(batch)
    return time_steps(step, arguments.steps, arguments.warmup), forward + backward


def transformers_llama(arguments: argparse.Namespace, tokens: torch.Tensor) -> float:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=arguments.hidden,
        intermediate_size=arguments.ffn,
        num_hidden_layers=arguments.layers,
        num_attention_heads=arguments.heads,
        num_key_value_heads=arguments.groups,
        head_dim=arguments.hidden // arguments.heads,
        vocab_size=arguments.vocab,
        tie_word_embeddings=True,
        max_position_embeddings=arguments.length,
    )
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa").cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()

    return time_steps(step, arguments.steps, arguments.warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    for name, default in [
        ("hidden", 768),
        ("layers", 12),
        ("heads", 12),
        ("groups", 4),
        ("ffn", 2048),
        ("vocab", 32000),
        ("rows", 8),
        ("length", 2048),
        ("steps", 20),
        ("warmup", 5),
    ]:
        parser.add_argument(f"--{name}", type=int, default=default)
    arguments = parser.parse_args()
    torch.manual_seed(0)
    tokens = torch.randint(0, arguments.vocab, (arguments.rows, arguments.length), device="cuda")
    count = tokens.numel()
    our_seconds, flops = ours(arguments, tokens)
    torch.cuda.empty_cache()
    peer_seconds = transformers_llama(arguments, tokens)
    print(f"shape: {vars(arguments)}; {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, seconds in [("blockzoo", our_seconds), ("transformers Llama (sdpa, autocast)", peer_seconds)]:
        mfu = flops / seconds / (PEAK_TFLOPS * 1e12)
        print(f"{name:40s} {seconds * 1e3:8.1f} ms/step  {count / seconds:>10,.0f} tokens/s  MFU {mfu:.1%}")
    print(f"ratio (blockzoo tokens/s ÷ transformers tokens/s): {peer_seconds / our_seconds:.2f}")


if __name__ == "__main__":
    main()
