"""Peak activation memory of one training step on a long sequence, whole and in micro-sequences, on the CPU.

    python benchmarks/micro_sequences.py [--tokens 8192] [--micro 512 1024 2048] [--recompute none full]
        [--json PATH] [--tiny]

The model: a hybrid of 4 blocks (attention, shortconv, attention with a window of 512, MoE of 4 experts top-2 after
attention), hidden 256, vocabulary 512, fp32; one micro-batch of `--tokens` random tokens in documents of 1/2, 1/4,
1/8... of it (the longest spans many micro-sequences). Each setting (micro_sequence_length none or each of `--micro`,
times each `--recompute` policy) runs in a fresh process: build the model, place the micro-batch, one forward and
backward pass of the trainer's objective (`LanguageModel.loss` over the labelled tokens plus the named losses).
Measured, in that process, from its resident memory (glibc returns freed large blocks to the system, so the resident
size follows the live tensors; the model, its gradients-to-be and the placed tokens are resident before the step):

- `held`: the resident memory once the forward pass is done, above that before it (`/proc/self/statm`): what the
  autograd graph keeps for the backward pass (the activations, the recomputation's inputs), plus the loss;
- `peak`: the process's peak resident memory during the step (forward and backward) above its resident memory
  before it (the high-water mark VmHWM, reset just before the step through /proc/self/clear_refs): what the step
  adds at its worst moment, transients and gradients included;
- the loss, which must be the same in every setting (the step is the same, only run in chunks).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/micro_sequences.py`: the repository on the path, as llama.py does
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

SUITE = "micro_sequences"
ATTENTION = {"type": "attention", "heads": 4, "head_groups": 2, "head_size": 64}
MLP = {"type": "mlp", "intermediate_size": 1024, "gated": True}
MOE = {
    "type": "moe",
    "experts": 4,
    "experts_per_token": 2,
    "intermediate_size": 512,
    "auxiliary_loss_coefficient": 0.01,
}


def run_config(tokens: int, micro: int | None, recompute: str, tiny: bool = False) -> dict:
    hidden, vocab = (32, 64) if tiny else (256, 512)
    scale = {"heads": 2, "head_size": 16} if tiny else {}
    blocks = {
        "attn": {"mixer": {**ATTENTION, **scale}, "mlp": MLP},
        "conv": {"mixer": {"type": "shortconv.gated_conv", "channels": hidden, "kernel_size": 4}, "mlp": MLP},
        "local": {"mixer": {**ATTENTION, **scale, "window_size": 512}, "mlp": MLP},
        "moe": {"mixer": {**ATTENTION, **scale}, "mlp": MOE},
    }
    return {
        "model": {
            "hidden_size": hidden,
            "embeddings": {"vocab_size": vocab},
            "decoder": {"type": "pattern", "num_blocks": 4, "pattern": list(blocks), "blocks": blocks},
        },
        "distributed": {"seed": 1234, "backend": "gloo", "micro_sequence_length": micro},
        "data": {"type": "random", "sequence_length": tokens, "micro_batch_size": 1},
        "training": {"recompute": recompute},
    }


def _reset_resident_peak() -> None:
    """Set the process's peak resident memory (VmHWM) to its resident memory now (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def _resident_peak() -> int:
    """The process's peak resident memory since the last reset, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line: the peak is measured on Linux")


def _resident() -> int:
    """The process's resident memory now, in bytes."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize()


def measure(tokens: int, micro: int | None, recompute: str, tiny: bool) -> dict:
    """One setting, in this process (call it in a fresh one: the resident peak is the process's)."""
    import torch

    from blockzoo.config import structure
    from blockzoo.data.dataset import MicroBatch, Sample
    from blockzoo.distributed.parallelize import parallelize
    from blockzoo.distributed.runtime import Distributed
    from blockzoo.model.language_model import LanguageModel
    from blockzoo.run_config import RunConfig
    from blockzoo.training.step import place_micro_batch

    torch.set_num_threads(1)
    config = structure(run_config(tokens, micro, recompute, tiny), RunConfig)
    distributed = Distributed(config.distributed, world_size=1, rank=0, local_rank=0)
    torch.manual_seed(0)
    model = parallelize(LanguageModel(config.model, distributed), config)
    # Documents of tokens/2, tokens/4, ... (the last one the rest): the longest spans many micro-sequences.
    lengths, left = [], tokens
    while left > tokens // 64 and left > 1:
        lengths.append(left // 2)
        left -= left // 2
    lengths.append(left)
    ids = torch.randint(0, config.model.embeddings.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
    placed = place_micro_batch(MicroBatch.pack([Sample(ids, lengths)]), distributed)
    start = _resident()
    _reset_resident_peak()
    cross_entropy, losses = model.loss(placed.tokens, placed.labels, placed.batch)
    objective = cross_entropy / placed.labelled() + sum(losses.values())
    held = _resident() - start
    objective.backward()
    return {
        "tokens": tokens,
        "micro_sequence_length": micro,
        "recompute": recompute,
        "held_mib": held / 2**20,
        "peak_mib": (_resident_peak() - start) / 2**20,
        "loss": float(objective.detach()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--micro", type=int, nargs="*", default=[512, 1024, 2048])
    parser.add_argument("--recompute", nargs="*", default=["none", "full"], choices=["none", "selective", "full"])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--tiny", action="store_true", help="a check of the code: 256 tokens, a tiny model")
    parser.add_argument("--one", nargs=3, metavar=("TOKENS", "MICRO", "RECOMPUTE"), help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    if arguments.one:  # a setting, in this fresh process
        tokens, micro, recompute = arguments.one
        print(json.dumps(measure(int(tokens), None if micro == "none" else int(micro), recompute, arguments.tiny)))
        return
    tokens = 256 if arguments.tiny else arguments.tokens
    micros = [64, 128] if arguments.tiny else arguments.micro
    print("| recompute | micro_sequence_length | held after the forward (MiB) | peak above start (MiB) | loss |")
    print("| --- | --- | --- | --- | --- |")
    records = []
    for recompute in arguments.recompute:
        for micro in [None, *micros]:
            command = [sys.executable, __file__, "--one", str(tokens), str(micro).lower(), recompute]
            command += ["--tiny"] if arguments.tiny else []
            result = subprocess.run(command, capture_output=True, text=True, check=True)
            record = json.loads(result.stdout.strip().splitlines()[-1])
            records.append(record)
            print(
                f"| {recompute} | {micro or 'whole'} | {record['held_mib']:.1f} | {record['peak_mib']:.1f} | "
                f"{record['loss']:.6f} |",
                flush=True,
            )
    if arguments.json:
        arguments.json.write_text("".join(json.dumps({"suite": SUITE, **record}) + "\n" for record in records))


if __name__ == "__main__":
    main()
