"""MLA forward+backward: ours against transformers' `DeepseekV3Attention` at one training shape, in one run, bf16.
Prints each contender's time, model TFLOP/s (our FLOP count), peak memory above the inputs, and the ratio.
Run on a GPU: `python mixers/mla/benchmarks/mla_layer.py [--sequences 4 --length 4096 ...]`.

The default shape is DeepSeek-V2-Lite-like: hidden 2048, 16 heads, q_lora_rank 1536, kv_lora_rank 512, nope 128,
rotary 64, values 128, 4 × 4096 tokens. Both get fp32 parameters and bf16 activations: ours casts its weights
(blockzoo's mixed precision), transformers' runs under autocast. Ours runs packed documents with `--implementations`
(auto picks `batched` here: SDPA over [documents, heads, length, head size], the documents being of one length);
transformers' gets a [sequences, length] batch, causal, with `attn_implementation` sdpa, and flash_attention_2 when
flash-attn is importable. The parameter counts are asserted equal.
"""

from __future__ import annotations

import argparse
import time

import torch

from blockzoo.config import structure
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.base import Batch
from blockzoo.layers.config import MixerConfig
from blockzoo.layers.dims import TensorDim
from blockzoo_mla.mla import MultiHeadLatentAttention


def measure(step, steps: int, warmup: int) -> tuple[float, int]:
    """(seconds per call of `step`, peak bytes allocated above what was allocated before it)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps, torch.cuda.max_memory_allocated() - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--query-rank", type=int, default=1536)
    parser.add_argument("--key-value-rank", type=int, default=512)
    parser.add_argument("--nope", type=int, default=128)
    parser.add_argument("--rotary", type=int, default=64)
    parser.add_argument("--value", type=int, default=128)
    parser.add_argument("--implementations", default="auto,varlen", help="ours: comma-separated `implementation`s")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    arguments = parser.parse_args()

    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    lengths = [arguments.length] * arguments.sequences
    tokens = sum(lengths)
    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(tokens, arguments.hidden, device="cuda", generator=generator).bfloat16()
    output_grad = torch.randn_like(hidden)
    distributed = Distributed(
        DistributedConfig(seed=1, backend="nccl", compute_dtype="bf16"), world_size=1, rank=0, local_rank=0
    )
    mla = {
        "type": "mla",
        "heads": arguments.heads,
        "query_rank": arguments.query_rank,
        "key_value_rank": arguments.key_value_rank,
        "nope_head_size": arguments.nope,
        "rotary_head_size": arguments.rotary,
        "value_head_size": arguments.value,
        "interleaved_rotary": True,
    }
    results: dict[str, tuple[float, int]] = {}
    flops = parameters = None
    for implementation in arguments.implementations.split(","):
        config = structure({**mla, "implementation": implementation}, MixerConfig)
        ours = MultiHeadLatentAttention(
            config, name="mixer", hidden_dim=TensorDim("hidden", arguments.hidden), distributed=distributed, lr_scale=1
        )
        forward_flops, backward_flops = ours.flops(Batch(lengths))
        flops, parameters = forward_flops + backward_flops, sum(p.numel() for p in ours.parameters())

        def ours_step(ours=ours) -> None:
            inputs = hidden.detach().requires_grad_()
            ours(inputs, Batch(lengths, device="cuda")).backward(output_grad)

        results[f"ours (blockzoo mla, {implementation})"] = measure(ours_step, arguments.steps, arguments.warmup)
        ours.to("meta")

    hf_config = transformers.DeepseekV3Config(
        hidden_size=arguments.hidden,
        num_attention_heads=arguments.heads,
        num_key_value_heads=arguments.heads,
        q_lora_rank=arguments.query_rank,
        kv_lora_rank=arguments.key_value_rank,
        qk_nope_head_dim=arguments.nope,
        qk_rope_head_dim=arguments.rotary,
        v_head_dim=arguments.value,
        rope_interleave=True,
        max_position_embeddings=arguments.length,
    )
    implementations = ["sdpa"]
    if transformers.utils.is_flash_attn_2_available():
        implementations.append("flash_attention_2")
    batched = hidden.view(arguments.sequences, arguments.length, arguments.hidden)
    positions = torch.arange(arguments.length, device="cuda")[None].expand(arguments.sequences, -1)
    rotary = DeepseekV3RotaryEmbedding(hf_config).to("cuda")
    for implementation in implementations:
        hf_config._attn_implementation = implementation
        theirs = DeepseekV3Attention(hf_config, layer_idx=0).cuda()
        theirs_parameters = sum(p.numel() for p in theirs.parameters())
        assert theirs_parameters == parameters, f"parameters: transformers {theirs_parameters}, ours {parameters}"

        def theirs_step(theirs=theirs) -> None:
            inputs = batched.detach().requires_grad_()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                cos, sin = rotary(inputs, positions)
                # No mask: SDPA is then causal over the whole row (is_causal), flash likewise.
                output, _ = theirs(inputs, (cos, sin), attention_mask=None)
            output.backward(output_grad.view_as(output))

        results[f"transformers DeepseekV3Attention ({implementation})"] = measure(
            theirs_step, arguments.steps, arguments.warmup
        )
        theirs.to("meta")

    shape = ", ".join(f"{key} {value}" for key, value in vars(arguments).items() if key not in ("steps", "warmup"))
    print(f"MLA forward+backward, bf16, {shape}; {tokens} tokens, {parameters} parameters each")
    for name, (seconds, peak) in results.items():
        tflops = flops / seconds / 1e12
        print(f"  {name:52s} {seconds * 1e3:8.2f} ms  {tflops:6.1f} TFLOP/s  peak {peak / 2**30:6.2f} GiB")
    ours_best = min(seconds for name, (seconds, _) in results.items() if name.startswith("ours"))
    for name, (seconds, _) in results.items():
        if name.startswith("transformers"):
            print(f"  ratio ({name} / our best): {seconds / ours_best:.2f}  (> 1: ours is faster)")


if __name__ == "__main__":
    main()
