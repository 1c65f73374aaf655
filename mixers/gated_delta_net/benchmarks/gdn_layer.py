"""Gated DeltaNet mixer forward+backward: ours against flash-linear-attention's own `fla.layers.GatedDeltaNet` layer
at the same shape, in one run, bf16. Prints times, peak memories and the ratio; asserts equal parameter counts.
Run on a GPU with flash-linear-attention installed (`pip install -e "mixers/gated_delta_net[kernels]"`):

    python mixers/gated_delta_net/benchmarks/gdn_layer.py [--sequences 4 --length 4096 --hidden 2048 --heads 16 ...]

Both run the same delta-rule kernel (fla's `chunk_gated_delta_rule`); what differs is around it: our one fused
in_proj and blockzoo's Triton convolution against fla's five projections, its gate projection and its
ShortConvolutions. Both get fp32 parameters and bf16 activations: ours casts its weights (blockzoo's mixed
precision), fla's runs under autocast. Ours runs packed documents (`--sequences` documents of `--length` tokens, the
state reset at each boundary); fla's gets them as a [sequences, length] batch.

Where fla refuses its gated backward (Hopper with Triton >= 3.4 and < 3.7.1 and no tilelang: its issue #640, wrong
gradients from one kernel), ours trains on its torch path, and fla's forward+backward is still timed with that
check lifted: a figure of its speed only (its gradients there are the wrong ones the check guards against).
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from blockzoo.config import structure
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.base import Batch
from blockzoo.layers.config import MixerConfig
from blockzoo.layers.dims import TensorDim
from blockzoo_gated_delta_net.delta_rule import fla_backward_refused, uses_fla_kernel
from blockzoo_gated_delta_net.gated_delta_net import GatedDeltaNet


def measure(step, steps: int, warmup: int) -> tuple[float, int]:
    """(seconds per call of `step`, peak bytes allocated during the timed calls)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps, torch.cuda.max_memory_allocated()


@contextlib.contextmanager
def fla_check_lifted(lifted: bool):
    """fla's refusal of its gated backward on this GPU lifted while timing it (see the module's docstring)."""
    if not lifted:
        yield
        return
    import fla.ops.common.chunk_o as chunk_o

    saved = chunk_o.TRITON_ABOVE_3_7_1
    chunk_o.TRITON_ABOVE_3_7_1 = True
    try:
        yield
    finally:
        chunk_o.TRITON_ABOVE_3_7_1 = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--modes", nargs="+", choices=["forward", "forward+backward"], default=["forward", "forward+backward"]
    )
    arguments = parser.parse_args()
    heads, size = arguments.heads, arguments.head_size

    config = structure(
        {
            "type": "gated_delta_net",
            "key_heads": heads,
            "value_heads": heads,
            "key_head_size": size,
            "value_head_size": size,
            "normalization": {"epsilon": 1e-5},  # fla's norm_eps
        },
        MixerConfig,
    )
    distributed = Distributed(
        DistributedConfig(seed=1, backend="nccl", compute_dtype="bf16"), world_size=1, rank=0, local_rank=0
    )
    ours = GatedDeltaNet(
        config, name="mixer", hidden_dim=TensorDim("hidden", arguments.hidden), distributed=distributed, lr_scale=1.0
    )
    lengths = [arguments.length] * arguments.sequences
    tokens = sum(lengths)
    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(tokens, arguments.hidden, device="cuda", generator=generator).bfloat16()
    output_grad = torch.randn_like(hidden)
    assert uses_fla_kernel(hidden), "flash-linear-attention is not importable: ours would take the torch path"
    forward_flops, backward_flops = ours.flops(Batch(lengths))

    def ours_step() -> None:
        inputs = hidden.detach().requires_grad_()
        ours(inputs, Batch(lengths, device="cuda")).backward(output_grad)

    from fla.layers import GatedDeltaNet as ReferenceGatedDeltaNet

    theirs = ReferenceGatedDeltaNet(
        hidden_size=arguments.hidden, expand_v=1, head_dim=size, num_heads=heads, mode="chunk", norm_eps=1e-5
    ).cuda()
    counts = {name: sum(p.numel() for p in layer.parameters()) for name, layer in (("ours", ours), ("fla", theirs))}
    assert counts["ours"] == counts["fla"], f"parameter counts differ: {counts}"
    batched = hidden.view(arguments.sequences, arguments.length, arguments.hidden)

    def theirs_step() -> None:
        inputs = batched.detach().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            output = theirs(inputs)[0]
        output.backward(output_grad.view_as(output))

    def ours_forward() -> None:
        with torch.no_grad():
            ours(hidden, Batch(lengths, device="cuda"))

    def theirs_forward() -> None:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            theirs(batched)

    refused = fla_backward_refused()
    modes = {"forward": (ours_forward, theirs_forward), "forward+backward": (ours_step, theirs_step)}
    modes = {mode: modes[mode] for mode in arguments.modes}
    shape = ", ".join(
        f"{key} {value}" for key, value in vars(arguments).items() if key not in ("steps", "warmup", "modes")
    )
    print(f"Gated DeltaNet, bf16, {shape}; {tokens} tokens, {counts['ours']} parameters each")
    for mode, (ours_run, theirs_run) in modes.items():
        flops = forward_flops + (backward_flops if mode != "forward" else 0)
        print(f" {mode}:")
        lifted = refused and mode != "forward"  # fla's refusal lifted for its own timing (module docstring)
        results = {}
        for name, run in (("ours (blockzoo gated_delta_net)", ours_run), ("fla.layers.GatedDeltaNet", theirs_run)):
            started = time.perf_counter()
            with fla_check_lifted(lifted and run is theirs_run):
                results[name] = seconds, peak = measure(run, arguments.steps, arguments.warmup)
            tflops = flops / seconds / 1e12
            print(
                f"  {name:34s} {seconds * 1e3:8.2f} ms  {tflops:6.1f} TFLOP/s  peak {peak / 2**30:6.2f} GiB"
                f"  ({time.perf_counter() - started:.0f} s with warm-up)"
            )
        ratio = results["fla.layers.GatedDeltaNet"][0] / results["ours (blockzoo gated_delta_net)"][0]
        print(f"  ratio (fla time / ours): {ratio:.2f}  (> 1: ours is faster)")
        if lifted:
            print("  (fla refuses its gated backward on this GPU and Triton, #640: ours trains on its torch path;")
            print("   fla's figure was taken with its check lifted: speed only, its gradients are wrong here)")


if __name__ == "__main__":
    main()
