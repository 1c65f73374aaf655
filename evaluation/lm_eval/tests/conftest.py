"""Shared fixtures: the local tasks, and tiny random models (a transformer, a Mamba 2 + attention hybrid) exported to
Hugging Face directories with a tokenizer trained on the tasks' texts. Nothing reaches the network."""

from __future__ import annotations

import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from lm_eval_tasks import END_OF_TEXT, train_tokenizer, write_tasks

import blockzoo

ATTENTION = {"type": "attention", "heads": 4, "head_groups": 2, "head_size": 16, "rotary": {"type": "default"}}
MLP = {"type": "mlp", "intermediate_size": 96, "gated": True, "activation": "silu"}
NORM = {"type": "rms_norm"}
MAMBA_2 = {"type": "mamba_2", "heads": 4, "head_size": 16, "groups": 1, "state_size": 16, "chunk_size": 8}
# kind -> (checkpoint format, decoder)
MODELS = {
    "transformer": ("llama", {"num_blocks": 2, "block": {"mixer": ATTENTION, "mlp": MLP, "normalization": NORM}}),
    "hybrid": (
        "bamba",
        {
            "type": "pattern",
            "num_blocks": 3,
            "pattern": ["ssm", "attn", "ssm"],
            "blocks": {
                "ssm": {"mixer": MAMBA_2, "mlp": MLP, "normalization": NORM},
                "attn": {"mixer": ATTENTION, "mlp": MLP, "normalization": NORM},
            },
        },
    ),
}


@pytest.fixture(scope="session")
def task_dir(tmp_path_factory) -> Path:
    return write_tasks(tmp_path_factory.mktemp("tasks"))


def export(kind: str, directory: Path, seed: int = 0) -> tuple[Any, Path]:
    """A tiny random model of `kind` (its output weight scaled up: logits far from uniform, so that choices differ
    and greedy generation is not a tie), exported with blockzoo.save to `directory` with its tokenizer."""
    checkpoint_format, decoder = MODELS[kind]
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(directory / "tokenizer.json")
    vocab_size = tokenizer.get_vocab_size()
    config = {"hidden_size": 64, "embeddings": {"vocab_size": vocab_size}, "decoder": decoder}
    model = blockzoo.build({"model": config, "distributed": {"seed": seed}})
    with torch.no_grad():
        model.head.output_weight.mul_(6.0)
    exported = directory / checkpoint_format
    blockzoo.save(model, exported, format=checkpoint_format)
    shutil.copy(directory / "tokenizer.json", exported / "tokenizer.json")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(exported / "tokenizer.json"), eos_token=END_OF_TEXT)
    fast.save_pretrained(exported)
    return model, exported


@pytest.fixture(scope="session")
def transformer(tmp_path_factory):
    return export("transformer", tmp_path_factory.mktemp("transformer"))


@pytest.fixture(scope="session")
def hybrid(tmp_path_factory):
    return export("hybrid", tmp_path_factory.mktemp("hybrid"))
