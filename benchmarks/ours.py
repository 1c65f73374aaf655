"""Our side of a training-step case: the run config of a setting, the model as the trainer builds it, the bare step.

A setting is what `--ours` takes: `compile=blocks,recompute=selective` (keys without a dot are `training.` fields;
dotted keys are paths from the run config's root, e.g. `training.recompute_blocks.attn=full`), or `default`. A
setting this blockzoo does not know makes the contender absent (the config names the field), not the run fail.
Keys `env.NAME` set an environment variable while the contender is built and timed, for choices that are not config
fields (e.g. `env.BLOCKZOO_CROSS_ENTROPY_KERNEL=triton`), so they are timed in the same process as the others.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from benchmarks.harness import Absent, Timing

ENVIRONMENT = "env."


def _items(setting: str) -> list[tuple[str, str]]:
    if setting.strip() in ("", "default"):
        return []
    found = []
    for item in setting.split(","):
        key, separator, value = item.strip().partition("=")
        if not separator or not key:
            raise ValueError(f"a setting is key=value[,key=value...], got {item!r} in {setting!r}")
        found.append((key, value))
    return found


def overrides(setting: str) -> list[str]:
    """`key=value` overrides of a setting, each a path from the run config's root."""
    return [
        f"{key if '.' in key else 'training.' + key}={value}"
        for key, value in _items(setting)
        if not key.startswith(ENVIRONMENT)
    ]


@contextlib.contextmanager
def environment(setting: str) -> Iterator[None]:
    """The setting's `env.NAME=value` items set in the environment within, as they were after."""
    changes = {key.removeprefix(ENVIRONMENT): value for key, value in _items(setting) if key.startswith(ENVIRONMENT)}
    saved = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def contender_name(setting: str) -> str:
    return f"ours ({setting.strip() or 'default'})"


def run_config(model: Mapping[str, Any], setting: str, *, rows: int, length: int, seed: int = 1234):
    """The RunConfig of `model` in bf16 (fp32 master weights) with `setting` applied; random data of `rows` ×
    `length` (what the trainer suite feeds the Trainer; the bare step takes its tokens directly)."""
    from blockzoo.config import ConfigError, merge, parse_overrides, structure
    from blockzoo.run_config import RunConfig

    base = {
        "model": dict(model),
        "distributed": {"compute_dtype": "bf16", "seed": seed},
        "data": {"type": "random", "sequence_length": length, "micro_batch_size": rows},
    }
    try:
        return structure(merge(base, parse_overrides(overrides(setting))), RunConfig)
    except ConfigError as error:
        raise Absent(f"this blockzoo refuses the setting {setting!r}: {error}") from None


def uses_policies(config) -> bool:
    training = config.training
    return (
        getattr(training, "compile", "none") != "none"
        or getattr(training, "recompute", "none") != "none"
        or any(policy != "none" for policy in getattr(training, "recompute_blocks", {}).values())
    )


def build(config):
    """(model, optimizer) as the trainer makes them: the model from the seed, `parallelize` (recomputation, compile)
    applied from outside, the configured optimizer (ours: AdamW)."""
    import blockzoo
    from blockzoo.distributed.runtime import Distributed
    from blockzoo.plugins import get_registry

    try:
        from blockzoo.distributed.parallelize import parallelize
    except ImportError:
        if uses_policies(config):
            raise Absent("blockzoo.distributed.parallelize is absent: cannot apply compile/recompute") from None
        parallelize = None
    torch.manual_seed(config.distributed.seed)
    model = blockzoo.build(config, distributed=Distributed(config.distributed))
    if parallelize is not None:
        model = parallelize(model, config) or model
    optimizer_class = get_registry().implementation_of(config.training.optimizer)
    return model, optimizer_class(config.training.optimizer, model.parameters())


def uses_cuda_graphs(config) -> bool:
    return getattr(config.training, "cuda_graphs", False)


def next_token_labels(tokens: torch.Tensor) -> torch.Tensor:
    """Labels of `[rows, length]` tokens packed row after row: each token's next one in its row, -100 at a row's end
    (what transformers' `labels=input_ids` computes: rows × (length - 1) predictions)."""
    labels = torch.full_like(tokens, -100)
    labels[:, :-1] = tokens[:, 1:]
    return labels.flatten()


def bare_step(model, optimizer, tokens: torch.Tensor, *, cuda_graphs: bool = False):
    """One optimizer step of `model` on `tokens` `[rows, length]` (one document per row) without the trainer: the
    loss, the backward pass, the optimizer. Returns a function that runs it and returns the mean loss (a tensor).
    `cuda_graphs` (the setting's `training.cuda_graphs`): the loss and backward pass replayed as one CUDA graph,
    through the Trainer's `StepGraph`."""
    from blockzoo.layers.base import Batch
    from blockzoo.training.step import PlacedMicroBatch

    rows, length = tokens.shape
    flat, labels = tokens.flatten(), next_token_labels(tokens)
    labelled = rows * (length - 1)

    def gradients(micro_batches):
        (micro,) = micro_batches
        optimizer.zero_grad(set_to_none=True)
        cross_entropy, losses = model.loss(micro.tokens, micro.labels, micro.batch)
        total = cross_entropy / labelled + sum(losses.values(), torch.zeros((), device=tokens.device))
        total.backward()
        return (cross_entropy.detach() / labelled).reshape(1), ()

    if cuda_graphs:
        try:
            from blockzoo.training.graphs import StepGraph
        except ImportError:
            raise Absent("blockzoo.training.graphs is absent: no CUDA graphs here") from None
        gradients = StepGraph(gradients, list(model.parameters()), print)

    def step() -> torch.Tensor:
        values, _ = gradients([PlacedMicroBatch(flat, labels, Batch([length] * rows, device=tokens.device))])
        optimizer.step()
        return values[0]

    return step


def timed_training(
    model: Mapping[str, Any], setting: str, tokens: torch.Tensor, time, reference: float | None, tolerance: float
) -> Timing:
    """Our model of the `model:` config in `setting`, built as the trainer builds it, its bare step on `tokens`
    timed by `time(step)`, its step-0 loss checked against `reference`."""
    config = run_config(model, setting, rows=len(tokens), length=tokens.shape[1])
    with environment(setting):
        built, optimizer = build(config)
        timing = time(bare_step(built, optimizer, tokens, cuda_graphs=uses_cuda_graphs(config)))
    timing.extra = loss_check(timing.first_value, reference, tolerance)
    return timing


def peer_step(loss, optimizer, device: torch.device):
    """A peer's training step: `loss()` under bf16 autocast (the peers keep fp32 master weights), its backward, the
    optimizer's step. Returns a function that runs it and returns the loss (a tensor)."""

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            value = loss()
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return value.detach()

    return step


@torch.no_grad()
def reference_loss(model, tokens: torch.Tensor, rows_per_call: int = 4) -> float:
    """The mean next-token loss of `model` (ours, no policy applied) over `tokens`, a few rows at a time (no
    gradient: the peers' and our settings' step-0 losses are compared to it)."""
    from blockzoo.layers.base import Batch

    rows, length = tokens.shape
    total = 0.0
    for start in range(0, rows, rows_per_call):
        part = tokens[start : start + rows_per_call]
        batch = Batch([length] * len(part), device=tokens.device)
        cross_entropy, _ = model.loss(part.flatten(), next_token_labels(part), batch)
        total += float(cross_entropy)
    return total / (rows * (length - 1))


def random_tokens(rows: int, length: int, vocab: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, vocab, (rows, length), device=device, generator=generator)


def reference(model: Mapping[str, Any], tokens: Mapping[str, torch.Tensor], convert) -> tuple[dict, dict[str, float]]:
    """Our model as built from the seed (what every setting starts from): its initial weights converted by
    `convert(named parameters)` into a peer's names and copied to the CPU (to load into each peer), and its loss on
    each case's `tokens` before any step (what each contender's step-0 loss is compared to)."""
    built, _ = build(run_config(model, "default", rows=1, length=1))
    try:
        converted = convert(dict(built.named_parameters()))
        weights = {name: tensor.detach().to("cpu", copy=True) for name, tensor in converted.items()}
        losses = {case: reference_loss(built, case_tokens) for case, case_tokens in tokens.items()}
    finally:
        del built
    return weights, losses


def loss_check(loss: torch.Tensor | None, reference: float | None, tolerance: float) -> dict[str, Any]:
    """A contender's step-0 loss and its relative difference to our model's (`loss0 ok`: within `tolerance`)."""
    if loss is None:
        return {}
    value = float(loss)
    if reference is None:
        return {"loss0": value}
    difference = abs(value - reference) / abs(reference)
    return {"loss0": value, "loss0 Δrel": difference, "loss0 ok": difference <= tolerance}
