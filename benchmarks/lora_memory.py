"""Trainable parameters and peak memory of LoRA fine-tuning against full fine-tuning of the same model, on the CPU.

    python benchmarks/lora_memory.py [--steps 3] [--json PATH] [--tiny]

The model: a Llama-shaped transformer (8 blocks, hidden 512, GQA 8 heads in 4 groups, gated MLP 1408, vocabulary
257, tied embeddings; ~25M parameters, fp32) trained by the `Trainer` for `--steps` steps on the embedded corpus
(sequences of 256, micro-batches of 4). LoRA: rank 8 on attention's query and value (the defaults). Each setting runs
in a fresh process. Measured there:

- trainable parameters (the optimizer's), and the trainer's own memory report: parameters, gradients and the
  optimizer's state (AdamW: two moments per trainable parameter);
- `peak`: the process's peak resident memory (ru_maxrss) above its resident memory once torch and blockzoo are
  imported (the model, its gradients, optimizer state, activations and transients of the steps).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = {
    "hidden_size": 512,
    "tied_embedding_weight": True,
    "embeddings": {"vocab_size": 257},
    "decoder": {
        "num_blocks": 8,
        "block": {
            "mixer": {"type": "attention", "heads": 8, "head_groups": 4, "head_size": 64},
            "mlp": {"type": "mlp", "intermediate_size": 1408, "gated": True},
        },
    },
}
LORA = {"type": "lora", "rank": 8, "alpha": 16.0}
# --tiny (tests): 2 blocks, hidden 64, 2 heads in 1 group of 32, MLP 128; sequences of 64, micro-batches of 2.
TINY = {
    **MODEL,
    "hidden_size": 64,
    "decoder": {
        "num_blocks": 2,
        "block": {
            "mixer": {"type": "attention", "heads": 2, "head_groups": 1, "head_size": 32},
            "mlp": {"type": "mlp", "intermediate_size": 128, "gated": True},
        },
    },
}


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def measure(setting: str, steps: int, tiny: bool = False) -> dict:
    import blockzoo  # noqa: F401 - imported before the baseline is taken
    from blockzoo.config import structure
    from blockzoo.run_config import RunConfig
    from blockzoo.training.trainer import Trainer

    baseline = _resident_bytes()
    with tempfile.TemporaryDirectory() as output_dir:
        model = TINY if tiny else MODEL
        model = {**model, "peft": LORA} if setting == "lora" else model
        data = {
            "model": model,
            "data": {"type": "embedded", "sequence_length": 64 if tiny else 256, "micro_batch_size": 2 if tiny else 4},
            "training": {
                "train_iters": steps,
                "optimizer": {"learning_rate": 1.0e-3},
                "evaluation": {"interval": None},
                "log_interval": 100,
                "checkpoint_interval": None,
                "output_dir": output_dir,
            },
        }
        trainer = Trainer(structure(data, RunConfig), log=lambda _: None)
        trainer.run()
        memory = trainer.memory
        trainable = sum(p.numel() for group in trainer.optimizer.param_groups for p in group["params"])
        total = sum(p.numel() for p in {id(p): p for p in trainer.model.parameters()}.values())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    return {
        "setting": setting,
        "parameters": total,
        "trainable": trainable,
        "parameter_bytes": memory.parameters,
        "gradient_bytes": memory.gradients,
        "optimizer_bytes": memory.optimizer,
        "peak_bytes": peak - baseline,
        "final_loss": trainer.history[-1].loss,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--tiny", action="store_true", help="a tiny model (tests)")
    parser.add_argument("--one", choices=["lora", "full"], help=argparse.SUPPRESS)  # a setting, in this process
    arguments = parser.parse_args()
    if arguments.one:
        print(json.dumps(measure(arguments.one, arguments.steps, arguments.tiny)))
        return
    results = []
    for setting in ("full", "lora"):
        command = [sys.executable, __file__, "--one", setting, "--steps", str(arguments.steps)]
        command += ["--tiny"] if arguments.tiny else []
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        results.append(json.loads(output.strip().splitlines()[-1]))
    mib = 2**20
    for result in results:
        gradients, state = result["gradient_bytes"] / mib, result["optimizer_bytes"] / mib
        print(
            f"{result['setting']:>4}: trainable {result['trainable']:,} of {result['parameters']:,} parameters; "
            f"parameters {result['parameter_bytes'] / mib:.1f} MiB, gradients {gradients:.1f} MiB, optimizer state "
            f"{state:.1f} MiB; peak resident {result['peak_bytes'] / mib:.0f} MiB above the imports"
        )
    if arguments.json:
        arguments.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
