"""Loading a checkpoint into a model on the CPU: blockzoo (native and Hugging Face directories) against transformers'
`from_pretrained` of the same Hugging Face directory, in one run, fp32, until every weight is in memory. Prints
seconds (best of `--repeats`) and the ratio (> 1: blockzoo is faster).

`python benchmarks/load_checkpoint.py [--hidden 2048 --layers 8 ...]` (needs blockzoo-attention, blockzoo-mlp,
blockzoo-huggingface and transformers). The default is a Llama-shaped model of 486M parameters.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
import transformers

import blockzoo

transformers.utils.logging.disable_progress_bar()


def best_of(repeats: int, load) -> float:
    """Seconds until the loaded model's weights are all in memory: transformers maps the files and reads a tensor
    when it is first used, so every parameter is read once (summed) before the clock stops."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model = load()
        with torch.no_grad():
            sum(float(parameter.sum()) for parameter in model.parameters())
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=5504)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=2)
    arguments = parser.parse_args()
    mixer = {
        "type": "attention",
        "heads": arguments.heads,
        "head_groups": arguments.kv_heads,
        "head_size": arguments.hidden // arguments.heads,
        "rotary": {"type": "default"},
    }
    mlp = {"type": "mlp", "intermediate_size": arguments.intermediate, "gated": True}
    model = blockzoo.build(
        {
            "model": {
                "hidden_size": arguments.hidden,
                "embeddings": {"vocab_size": arguments.vocab},
                "decoder": {"num_blocks": arguments.layers, "block": {"mixer": mixer, "mlp": mlp}},
            }
        }
    )
    parameters = sum(parameter.numel() for parameter in model.parameters())
    with tempfile.TemporaryDirectory() as directory:
        native, huggingface = Path(directory) / "native", Path(directory) / "hf"
        blockzoo.save(model, native)
        blockzoo.save(model, huggingface, format="llama")
        del model
        ours_native = best_of(arguments.repeats, lambda: blockzoo.load(native))
        ours = best_of(arguments.repeats, lambda: blockzoo.load(huggingface))
        theirs = best_of(
            arguments.repeats,
            lambda: transformers.AutoModelForCausalLM.from_pretrained(huggingface, dtype=torch.float32),
        )
    print(f"{parameters / 1e6:.0f}M parameters, fp32, CPU ({torch.get_num_threads()} threads)")
    print(f"blockzoo.load(native checkpoint): {ours_native:.2f} s")
    print(f"blockzoo.load(Hugging Face directory): {ours:.2f} s")
    print(f"transformers from_pretrained(same directory): {theirs:.2f} s")
    print(f"ratio (transformers / blockzoo, Hugging Face directory): {theirs / ours:.2f}")


if __name__ == "__main__":
    main()
