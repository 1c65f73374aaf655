"""Mamba 2 mixer forward+backward: ours against mamba_ssm's own `Mamba2` module (`use_mem_eff_path=False`) at the
same shape, in one run, bf16. Prints times, model TFLOP/s (our FLOP count) and the ratio.
Run on a GPU with mamba_ssm installed: `python mixers/mamba_2/benchmarks/mamba2_layer.py [--sequences 8 ...]`.
`BLOCKZOO_SSD_AUTOTUNE=full` lets the SSD kernels autotune over mamba_ssm's whole config lists (both contenders use
the same kernels, so they share the choice).

Both get fp32 parameters and bf16 activations: ours casts its weights (blockzoo's mixed precision), mamba_ssm's runs
under autocast, as its training scripts do. Ours runs packed documents (`--sequences` documents of `--length`
tokens, state reset at each boundary); mamba_ssm's gets them as a [sequences, length] batch.

`--compare-convolutions` also times ours with its convolution taken by the cuDNN path (`causal_conv1d`'s torch path)
and by `torch.compile` of `shifted_causal_conv1d` instead of blockzoo's Triton kernels.
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

import torch

from blockzoo.config import structure
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.base import Batch
from blockzoo.layers.config import MixerConfig
from blockzoo.layers.dims import TensorDim
from blockzoo_mamba_2.mamba_2 import Mamba2
from blockzoo_ssm import conv, import_mamba_ssm, layers
from blockzoo_ssm.scan import positions_in_batch


def time_step(step, steps: int, warmup: int) -> float:
    """Seconds per call of `step`, waiting for the GPU's work."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--expand", type=int, default=2)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--state", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--compare-convolutions", action="store_true", help="also time the other convolution paths")
    arguments = parser.parse_args()

    heads = arguments.expand * arguments.hidden // arguments.head_size
    config = structure(
        {
            "type": "mamba_2",
            "heads": heads,
            "head_size": arguments.head_size,
            "groups": arguments.groups,
            "state_size": arguments.state,
            "chunk_size": arguments.chunk,
        },
        MixerConfig,
    )
    distributed = Distributed(
        DistributedConfig(seed=1, backend="nccl", compute_dtype="bf16"), world_size=1, rank=0, local_rank=0
    )
    ours = Mamba2(
        config, name="mixer", hidden_dim=TensorDim("hidden", arguments.hidden), distributed=distributed, lr_scale=1.0
    )
    lengths = [arguments.length] * arguments.sequences
    tokens = sum(lengths)
    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(tokens, arguments.hidden, device="cuda", generator=generator).bfloat16()
    output_grad = torch.randn_like(hidden)
    forward_flops, backward_flops = ours.flops(Batch(lengths))

    def ours_step() -> None:
        inputs = hidden.detach().requires_grad_()
        ours(inputs, Batch(lengths, device="cuda")).backward(output_grad)

    results = {"ours (blockzoo mamba_2)": time_step(ours_step, arguments.steps, arguments.warmup)}
    if arguments.compare_convolutions:
        with mock.patch.object(conv, "uses_triton_kernel", lambda *args: False):
            results["ours, cuDNN convolution"] = time_step(ours_step, arguments.steps, arguments.warmup)
        compiled = torch.compile(conv.shifted_causal_conv1d)

        def compiled_convolution(x, weight, bias, batch, *, activation=None, state=None):
            return compiled(x, weight, bias, positions_in_batch(batch), activation=activation)

        with mock.patch.object(layers, "causal_conv1d", compiled_convolution):
            results["ours, torch.compile convolution"] = time_step(ours_step, arguments.steps, arguments.warmup)
    ours.to("meta")

    import_mamba_ssm()  # The project's one adapter (mamba_ssm 2.3.2's __init__ imports a compiled module).
    from mamba_ssm.modules.mamba2 import Mamba2 as ReferenceMamba2

    theirs = ReferenceMamba2(
        d_model=arguments.hidden,
        d_state=arguments.state,
        expand=arguments.expand,
        headdim=arguments.head_size,
        ngroups=arguments.groups,
        chunk_size=arguments.chunk,
        use_mem_eff_path=False,
        device="cuda",
    )
    batched = hidden.view(arguments.sequences, arguments.length, arguments.hidden)

    def theirs_step() -> None:
        inputs = batched.detach().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            output = theirs(inputs)
        output.backward(output_grad.view_as(output))

    results["mamba_ssm Mamba2 (use_mem_eff_path=False)"] = time_step(theirs_step, arguments.steps, arguments.warmup)

    shape = ", ".join(f"{key} {value}" for key, value in vars(arguments).items() if key not in ("steps", "warmup"))
    print(f"Mamba 2 mixer forward+backward, bf16, {shape} ({heads} heads); {tokens} tokens")
    reference = results["ours (blockzoo mamba_2)"]
    for name, seconds in results.items():
        tflops = (forward_flops + backward_flops) / seconds / 1e12
        print(f"  {name:44s} {seconds * 1e3:8.2f} ms  {tflops:6.1f} TFLOP/s  {tokens / seconds / 1e6:6.2f} M tokens/s")
    theirs_seconds = results["mamba_ssm Mamba2 (use_mem_eff_path=False)"]
    print(f"  ratio (mamba_ssm time / ours): {theirs_seconds / reference:.2f}  (> 1: ours is faster)")


if __name__ == "__main__":
    main()
