"""Greedy generation: `blockzoo`'s `LanguageModel.generate` against transformers' `generate` on the same exported
weights (a Llama-format directory written by `blockzoo.save(..., format="llama")`), batch of one.

    python benchmarks/generate.py [--config examples/demo.yaml] [--new-tokens 300] [--repeats 2]
    python benchmarks/generate.py --config examples/gpu.yaml --device cuda --dtype bf16     # on a GPU

`--dtype` is the dtype of the weights and the computation of both (bf16: blockzoo's model is loaded with
`compute_dtype: bf16` and its parameters cast to bf16, as transformers' `from_pretrained(dtype=torch.bfloat16)`
holds them: inference keeps no fp32 master weights). On a GPU the peak memory is `max_memory_allocated` while
generating (loading's peak printed beside it: blockzoo loads fp32 weights, then casts them).

Each contender runs in a fresh process (so its peak resident memory is its own): it loads the directory, generates
`--new-tokens` tokens from the same prompt (best of `--repeats`), and reports seconds, tokens/s, peak RSS and its
tokens. Printed: both figures, the ratio (> 1: blockzoo is faster) and how many leading tokens agree (greedy decoding
of the same weights: they agree until float rounding tips a near tie). The model is the config's, randomly
initialized with its seed (the demo's by default: a 4-block transformer of hidden size 128).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

PROMPT = list(b"Once upon a time")


def run_contender(name: str, directory: str, new_tokens: int, repeats: int, device: str, dtype: str) -> dict:
    """In this process: load `directory` with `name`'s library, generate, and return the figures."""
    import torch

    torch.manual_seed(0)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    if name == "blockzoo":
        import blockzoo
        from blockzoo.distributed.config import DistributedConfig
        from blockzoo.distributed.runtime import Distributed

        backend = "nccl" if device == "cuda" else "gloo"
        config = DistributedConfig(compute_dtype=dtype, backend=backend)
        model = blockzoo.load(directory, distributed=Distributed(config, world_size=1, rank=0, local_rank=0))
        model.to(torch_dtype)

        def generate() -> list[int]:
            return model.generate([PROMPT], new_tokens)[0]

    else:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype).to(device)
        prompt = torch.tensor([PROMPT], device=device)

        def generate() -> list[int]:
            output = model.generate(
                prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
            )
            return output[0, len(PROMPT) :].tolist()

    model.eval()
    if device == "cuda":  # the peak of generating (a library may load through other dtypes first)
        load_peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    seconds = []
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            tokens = generate()
            seconds.append(time.perf_counter() - start)  # (the tokens were read back: the device is done)
    figures = {"seconds": min(seconds), "tokens": tokens, "threads": torch.get_num_threads()}
    if device == "cuda":
        figures |= {"peak_bytes": torch.cuda.max_memory_allocated(), "load_peak_bytes": load_peak}
    else:
        figures["peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(Path(__file__).parent.parent / "examples" / "demo.yaml"))
    parser.add_argument("--new-tokens", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--contender", choices=["blockzoo", "transformers"], help=argparse.SUPPRESS)
    parser.add_argument("--directory", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.contender:  # a child: one contender, its figures as JSON on stdout
        figures = run_contender(
            arguments.contender,
            arguments.directory,
            arguments.new_tokens,
            arguments.repeats,
            arguments.device,
            arguments.dtype,
        )
        print(json.dumps(figures))
        return

    import blockzoo

    with tempfile.TemporaryDirectory() as directory:
        model = blockzoo.build(arguments.config)
        parameters = sum(parameter.numel() for parameter in model.parameters())
        blockzoo.save(model, directory, format="llama")
        del model
        results = {}
        for name in ("blockzoo", "transformers"):
            command = [sys.executable, __file__, "--contender", name, "--directory", directory]
            command += ["--new-tokens", str(arguments.new_tokens), "--repeats", str(arguments.repeats)]
            command += ["--device", arguments.device, "--dtype", arguments.dtype]
            completed = subprocess.run(command, capture_output=True, text=True, check=False)
            if completed.returncode != 0:
                sys.exit(f"{name} failed:\n{completed.stderr[-3000:]}")
            results[name] = json.loads(completed.stdout.strip().splitlines()[-1])
    ours, theirs = results["blockzoo"], results["transformers"]
    agree = next(
        (index for index, (a, b) in enumerate(zip(ours["tokens"], theirs["tokens"], strict=True)) if a != b),
        len(ours["tokens"]),
    )
    print(
        f"{arguments.config}: {parameters / 1e6:.2f}M parameters, {arguments.dtype}, "
        + (f"CPU ({ours['threads']} threads), " if arguments.device == "cpu" else "GPU, ")
        + f"{arguments.new_tokens} new tokens, greedy, best of {arguments.repeats}"
    )
    for name, figures in results.items():
        rate, peak = arguments.new_tokens / figures["seconds"], figures["peak_bytes"] / 2**20
        if arguments.device == "cpu":
            memory = f"peak RSS {peak:.0f} MiB"
        else:
            memory = f"peak allocated generating {peak:.0f} MiB (loading {figures['load_peak_bytes'] / 2**20:.0f} MiB)"
        print(f"  {name}: {figures['seconds']:.2f} s, {rate:.0f} tokens/s, {memory}")
    print(f"  speed blockzoo / transformers: {theirs['seconds'] / ours['seconds']:.2f}x")
    print(f"  memory blockzoo / transformers: {ours['peak_bytes'] / theirs['peak_bytes']:.2f}x")
    print(f"  the first {agree} of {arguments.new_tokens} tokens agree")


if __name__ == "__main__":
    main()
