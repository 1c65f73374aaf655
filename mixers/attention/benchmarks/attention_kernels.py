"""Time the attention kernels (forward + backward) on the GPU at realistic shapes, to choose `auto` by measurement.

    python mixers/attention/benchmarks/attention_kernels.py [--tokens 8192] [--heads 16] [--head-groups 16]
        [--head-size 128] [--dtype bf16] [--iterations 20]

For each scenario (documents packed into `--tokens` tokens, with or without a window) and each kernel of
`blockzoo_attention.kernels`, prints the time to prepare the batch's masks (once per batch), the time of one
forward + backward, the achieved TFLOP/s (model FLOPs: 3 × 4·heads·head_size per attended pair), the ratio to
the fastest kernel, and the largest difference of the output from the `torch` kernel's.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from blockzoo.layers.base import Batch
from blockzoo_attention.kernels import KERNELS, Segments

HEADER = (
    f"  {'kernel':8s} {'prepare ms':>10s} {'fwd+bwd ms':>10s} {'TFLOP/s':>8s} {'÷ fastest':>9s} {'max |Δ torch|':>14s}"
)


def scenarios(tokens: int) -> dict[str, tuple[list[int], int | None]]:
    generator = torch.Generator().manual_seed(0)
    cuts = sorted(torch.randperm(tokens - 1, generator=generator)[:7].add(1).tolist())
    varied = [end - start for start, end in zip([0, *cuts], [*cuts, tokens])]
    return {
        f"2 documents of {tokens // 2}": ([tokens // 2] * 2, None),
        f"8 documents of {min(varied)}..{max(varied)}": (varied, None),
        f"2 documents of {tokens // 2}, window 1024": ([tokens // 2] * 2, 1024),
    }


def time_ms(function, iterations: int) -> float:
    """Median milliseconds of `function()` on the GPU, after warm-up runs (compilation)."""
    for _ in range(3):
        function()
    times = []
    for _ in range(iterations):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(kernel, segments: Segments, window: int | None, tensors, iterations: int):
    """(prepare ms, forward + backward ms, output) of one kernel."""
    query, key, value, output_grad = tensors
    scale = query.shape[-1] ** -0.5
    prepare_ms = time_ms(lambda: kernel.prepare(segments, segments, True, window), iterations)
    prepared = kernel.prepare(segments, segments, True, window)

    def step() -> torch.Tensor:
        output = kernel.attend(query, key, value, prepared, scale)
        output.backward(output_grad)
        return output

    step_ms = time_ms(step, iterations)
    return prepare_ms, step_ms, step().detach().float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-groups", type=int, default=16)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--iterations", type=int, default=20)
    arguments = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[arguments.dtype]
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {arguments.dtype}, {arguments.tokens} tokens, "
        f"{arguments.heads} heads / {arguments.head_groups} key-value heads × {arguments.head_size}"
    )
    generator = torch.Generator(device="cuda").manual_seed(0)

    def tensor(heads: int) -> torch.Tensor:
        shape = (arguments.tokens, heads, arguments.head_size)
        return torch.randn(shape, device="cuda", dtype=dtype, generator=generator).requires_grad_()

    query, key, value = tensor(arguments.heads), tensor(arguments.head_groups), tensor(arguments.head_groups)
    output_grad = torch.randn_like(query)

    for scenario, (lengths, window) in scenarios(arguments.tokens).items():
        batch = Batch(lengths, device="cuda")
        seen = (batch.positions + 1) if window is None else (batch.positions + 1).clamp(max=window)
        flops = 3 * 4 * arguments.heads * arguments.head_size * int(seen.sum())
        print(f"\n{scenario}")
        print(HEADER)
        results, reference = {}, None
        for name, kernel in KERNELS.items():
            if (reason := kernel.unavailable(query)) is not None:
                print(f"  {name:8s} unavailable: {reason}")
                continue
            prepare_ms, step_ms, output = measure(
                kernel, Segments.of(batch), window, (query, key, value, output_grad), arguments.iterations
            )
            reference = output if name == "torch" else reference
            difference = float((output - reference).abs().max()) if reference is not None else float("nan")
            results[name] = (prepare_ms, step_ms, flops / step_ms / 1e9, difference)
        fastest = min(step_ms for _, step_ms, _, _ in results.values())
        for name, (prepare_ms, step_ms, tflops, difference) in results.items():
            ratio = step_ms / fastest
            print(f"  {name:8s} {prepare_ms:10.3f} {step_ms:10.3f} {tflops:8.1f} {ratio:9.2f} {difference:14.2e}")


if __name__ == "__main__":
    main()
