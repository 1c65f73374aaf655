"""Helpers of a plugin's whole-model tests: an example config shortened to run in seconds on the CPU, one backward
that must reach every parameter, a short training whose loss falls and whose checkpoint reloads the trained model,
and greedy decoding by full forwards (what generation through the states and caches must equal).

```python
run_config = shortened_example(EXAMPLES / "my_mixer.yaml", tmp_path)
check_every_parameter_gets_a_gradient(blockzoo.build(run_config))
check_trains_and_reloads(run_config, moved=lambda name: name.startswith("decoder.0.mixer."))
```
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

import blockzoo
from blockzoo.config import read_yaml, structure
from blockzoo.run_config import RunConfig
from blockzoo.training.trainer import Trainer


def shortened_example(example: Path, output_dir: Path, *, seed: int = 7) -> RunConfig:
    """The run config of the example YAML file `example`, shortened for a test: sequences of 64 tokens, micro-batches
    of 4, 12 steps (logged every 4, the checkpoint at the last) writing to `output_dir`, no evaluation, 2 warm-up
    steps, learning rate 1e-2; one gloo process seeded with `seed`."""
    data = read_yaml(example)
    data["data"].update(sequence_length=64, micro_batch_size=4)
    data["training"].update(train_iters=12, log_interval=4, output_dir=str(output_dir), checkpoint_interval=12)
    del data["training"]["evaluation"]
    data["training"]["schedule"]["warmup_iters"] = 2
    data["training"]["optimizer"]["learning_rate"] = 1.0e-2
    return structure({**data, "distributed": {"seed": seed, "backend": "gloo"}}, RunConfig)


def check_every_parameter_gets_a_gradient(model: torch.nn.Module, *, vocab: int = 257, skip_frozen: bool = False):
    """One backward of the next-token cross-entropy of random tokens (2 sequences of 40, below `vocab`) gives every
    parameter a nonzero gradient (with `skip_frozen`, every one that requires a gradient)."""
    tokens = torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    for name, parameter in model.named_parameters():
        if skip_frozen and not parameter.requires_grad:
            continue
        assert parameter.grad is not None and bool(parameter.grad.abs().sum() > 0), name


def check_trains_and_reloads(
    run_config: RunConfig, *, moved: Callable[[str], bool], vocab: int = 257
) -> tuple[Trainer, torch.nn.Module]:
    """Training `run_config` (with a checkpoint at its last step) keeps the loss finite and lowers it by more than
    1; every parameter whose name `moved` accepts changes (the same seed builds the same initial weights); the
    checkpoint reloads the trained model exactly (logits of tokens below `vocab`). Returns the trainer and the
    reloaded model."""
    initial = dict(blockzoo.build(run_config).named_parameters())
    trainer = Trainer(run_config, log=lambda message: None)
    history = trainer.run()
    assert all(torch.isfinite(torch.tensor(record.loss)) for record in history)
    assert history[-1].loss < history[0].loss - 1.0, [record.loss for record in history]
    for name, parameter in trainer.model.named_parameters():
        if moved(name):
            assert not torch.equal(parameter.detach(), initial[name].detach()), name
    reloaded = blockzoo.load(run_config.training.output_dir)
    tokens = torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens), trainer.model(tokens), atol=0, rtol=0)
    return trainer, reloaded


def greedy_by_full_forward(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """The `steps` tokens greedy decoding appends to `prompt`, each by a full forward of all the tokens so far."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt) :]
