"""The blended dataset's cost per step against a plain memmap dataset and against the step of examples/blended.yaml.

    python examples/blended_data.py && python benchmarks/blended_loader.py [--data data/blended] [--steps 30]

Times `next(batches)` (a micro-batch: 8 sequences of 256 tokens, packed, labels made) of the three-source blend of
examples/blended.yaml and of its `web` source alone as a `memmap` dataset, from the start of the stream and from a
position a million sequences in (a resumed run: the blend index there is walked once first, timed apart), and the
training step of the example's model on this CPU (forward, backward, AdamW, one micro-batch). Goal: the blend costs
at most 1% of a step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch

from blockzoo.config import load, structure
from blockzoo.data.config import DatasetConfig
from blockzoo.data.dataset import build_dataset
from blockzoo.layers.base import Batch
from blockzoo.model.language_model import LanguageModel
from blockzoo.run_config import RunConfig

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "blended.yaml"


def per_micro_batch(batches, count: int) -> float:
    """Median seconds of `next(batches)` over `count` calls (after one untimed)."""
    next(batches)
    times = []
    for _ in range(count):
        start = time.perf_counter()
        next(batches)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_seconds(run_config, steps: int) -> float:
    """Median seconds of a training step of the example's model on one micro-batch of the blend."""
    from blockzoo.distributed.runtime import Distributed

    distributed = Distributed(run_config.distributed, world_size=1, rank=0, local_rank=0)
    model = LanguageModel(run_config.model, distributed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = build_dataset(run_config.data, seed=0, model_vocab_size=run_config.model.embeddings.vocab_size)
    batches = data.training_batches()
    times = []
    for index in range(steps + 2):
        micro = next(batches)
        start = time.perf_counter()
        loss, _ = model.loss(micro.tokens, micro.labels, Batch(micro.lengths.tolist()))
        (loss / int((micro.labels != -100).sum())).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if index >= 2:
            times.append(time.perf_counter() - start)
    distributed.shutdown()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="data/blended", help="where examples/blended_data.py wrote the sources")
    parser.add_argument("--steps", type=int, default=30)
    arguments = parser.parse_args()
    overrides = [f"data.sources.{name}.path={arguments.data}/{name}" for name in ("web", "code", "math")]
    run_config = load(RunConfig, EXAMPLE, overrides)
    blend = build_dataset(run_config.data, seed=0)
    web = run_config.data.sources["web"]
    plain = build_dataset(
        structure(
            {
                "type": "memmap",
                "path": web.path,
                "validation_fraction": web.validation_fraction,
                "sequence_length": run_config.data.sequence_length,
                "micro_batch_size": run_config.data.micro_batch_size,
            },
            DatasetConfig,
        ),
        seed=0,
    )
    count = 200
    far = {"next_sample": 1_000_000}
    results = {
        "memmap (web alone), from the start": per_micro_batch(plain.training_batches(), count),
        "blended (3 sources), from the start": per_micro_batch(blend.training_batches(), count),
        "memmap, from sequence 1,000,000": per_micro_batch(plain.training_batches(position=far), count),
    }
    start = time.perf_counter()
    resumed = blend.training_batches(position=far)
    next(resumed)
    walk = time.perf_counter() - start
    results["blended, from sequence 1,000,000"] = per_micro_batch(resumed, count)
    step = step_seconds(run_config, arguments.steps)
    print(f"training step of examples/blended.yaml (one micro-batch, forward + backward + AdamW): {step * 1e3:.1f} ms")
    for label, seconds in results.items():
        print(f"{label:40s} {seconds * 1e6:8.1f} µs per micro-batch  ({seconds / step:.4%} of a step)")
    extra = results["blended (3 sources), from the start"] - results["memmap (web alone), from the start"]
    print(f"the blend's extra cost: {extra * 1e6:.1f} µs per micro-batch ({extra / step:.4%} of a step)")
    print(f"a resume at sequence 1,000,000: its first micro-batch {walk * 1e3:.0f} ms (the index walked once)")


if __name__ == "__main__":
    main()
