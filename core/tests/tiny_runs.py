"""The tiny run of the trainer's tests: a bigram-like model (no mixer, no MLP: embeddings, final norm, output
projection, which the core alone builds) on the embedded corpus, a few steps on the CPU."""

from pathlib import Path

from blockzoo.config import load
from blockzoo.run_config import RunConfig

VOCAB = 257  # the byte tokenizer of the embedded corpus
BASE = {
    "model": {
        "hidden_size": 16,
        "embeddings": {"vocab_size": VOCAB},
        "decoder": {"num_blocks": 1, "block": {"mixer": {"type": "none"}, "mlp": {"type": "none"}}},
    },
    "distributed": {"backend": "gloo"},  # CPU, also where CUDA is present
    "data": {
        "type": "embedded",
        "sequence_length": 32,
        "micro_batch_size": 2,
        "num_documents": 4,
        "validation_fraction": 0.25,
    },
    "training": {
        "train_iters": 4,
        "optimizer": {"learning_rate": 0.01},
        "schedule": {"decay": "constant"},
        "log_interval": 1,
    },
}


def configure(output_dir: Path, *overrides: str) -> RunConfig:
    """The base run config with `key=value` overrides (as on the command line), writing to `output_dir`."""
    return load(RunConfig, data=BASE, overrides=[f"training.output_dir={output_dir}", *overrides])
