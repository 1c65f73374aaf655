"""`check_tensor_parallel`: a layer split between tensor-parallel gloo ranks against one process (see the package)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from blockzoo.config import Config, ConfigError, structure, to_dict
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.base import Batch, Layer
from blockzoo.layers.config import GENERATION_CACHE, SEQUENCE_TENSOR_PARALLEL, TENSOR_PARALLEL
from blockzoo.plugins import get_registry
from blockzoo_testing.decoding import DECODING_FIX, DECODING_LENGTHS, DECODING_STEPS, decoding_problems
from blockzoo_testing.parallel.jobs import DEFAULT_LENGTHS, DEFAULT_TOLERANCE, CheckedCase, run_checks
from blockzoo_testing.runs import (
    DEFAULT_HIDDEN_SIZE,
    DEFAULT_SEED,
    ConformanceError,
    build,
    layer_inputs,
    mismatch,
    run_layer,
    single_process,
)


def check_tensor_parallel(
    config_class: type[Config],
    cases: Mapping[str, Config | Mapping[str, Any]],
    *,
    hidden_size: int = DEFAULT_HIDDEN_SIZE,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    tolerance: Mapping[str, float] = DEFAULT_TOLERANCE,
    tensor_parallel: int = 2,
    seed: int = DEFAULT_SEED,
    refused: Sequence[tuple[Config | Mapping[str, Any], str]] = (),
) -> None:
    """Each case, split between `tensor_parallel` gloo ranks, computes what it computes on one process (see the
    module); all in one set of processes. `cases`: name -> a config, or its plain data structured as `config_class`
    (a plugin's config class, or MixerConfig / MLPConfig with the `type`). `refused`: (config, regular expression)
    pairs the layer must refuse to build at this layout, with a ValueError whose message matches.

    Raises ConformanceError listing every problem of every case, then what to fix."""

    def resolve(config: Config | Mapping[str, Any], what: str) -> tuple[Any, Config]:
        if not isinstance(config, Config):
            try:
                config = structure(config, config_class)
            except ConfigError as error:
                raise ConformanceError(f"{what} does not structure as {config_class.__name__}: {error}") from None
        return get_registry(strict=False).implementation_of(config), config

    problems, checked = [], []
    for name, case in cases.items():
        implementation, config = resolve(case, f"case {name!r}")
        if TENSOR_PARALLEL not in config.capabilities:
            problems.append(f"case {name!r}: {type(config).__name__} does not declare tensor_parallel")
            continue
        try:
            config.check_tensor_parallel(tensor_parallel)
        except ValueError as error:
            problems.append(f"case {name!r} cannot be split between {tensor_parallel} tensor-parallel ranks: {error}")
            continue
        sequence_tensor_parallel = SEQUENCE_TENSOR_PARALLEL in config.capabilities
        generation = config.kind == "mixer" and GENERATION_CACHE in config.capabilities
        checked.append(CheckedCase(name, implementation, config, sequence_tensor_parallel, generation))
    if problems:
        raise ConformanceError("\n".join(problems))
    refusals = []
    for data, pattern in refused:
        implementation, config = resolve(data, f"the config refused with {pattern!r}")
        label = f"{type(config).__name__} {to_dict(config, explicit_only=True)}"
        refusals.append(_Refusal(implementation, config, pattern, label))
    job = _ParallelJob(
        cases=tuple(checked),
        refused=tuple(refusals),
        hidden_size=hidden_size,
        lengths=tuple(lengths),
        tolerance=dict(tolerance),
        seed=seed,
        tensor_parallel=tensor_parallel,
    )
    run_checks(tensor_parallel, _check_parallel, job)


@dataclasses.dataclass(frozen=True)
class _Refusal:
    implementation: Any
    config: Config
    pattern: str  # Of the ValueError's message.
    label: str = ""  # Written in the parent: to_dict needs the registry, which a rank's may lack.

    def __post_init__(self) -> None:
        if not self.label:
            object.__setattr__(
                self, "label", f"{type(self.config).__name__} {to_dict(self.config, explicit_only=True)}"
            )


@dataclasses.dataclass(frozen=True)
class _ParallelJob:
    cases: tuple[CheckedCase, ...]
    refused: tuple[_Refusal, ...]
    hidden_size: int
    lengths: tuple[int, ...]
    tolerance: dict[str, float]
    seed: int
    tensor_parallel: int


_TENSOR_PARALLEL_FIX = (
    "A layer that declares tensor_parallel must give the single-process outputs and gradients with its weights split "
    "between ranks: input projections column-parallel (an output dim with parallel=True), the output projection "
    "row-parallel (an input dim with parallel=True), every per-channel or per-head computation on this rank's "
    "channels or heads. What needs every channel (a norm over the whole inner dim) cannot be split: refuse it in "
    "check_tensor_parallel(n), or do not declare tensor_parallel."
)
_SEQUENCE_PARALLEL_FIX = (
    "Under sequence_tensor_parallel the layer receives and returns this rank's slice of the tokens: the column-"
    "parallel Linear gathers them and the row-parallel one scatters them back; anything computed on the input or "
    "output outside those Linears sees only this rank's tokens. Do not declare sequence_tensor_parallel if the "
    "layer cannot work so."
)
_SHARD_FIX = (
    "Each parameter's dims say how it is split (a parallel=True dim): the ranks' shards must assemble to the "
    "single-process tensor, which is what checkpoints hold."
)
_GRADIENT_FIX = (
    "A replicated parameter whose gradient on a rank covers only that rank's tokens or heads must say so: "
    "create_parameter(..., token_sharded_input=True or partial_gradient=True), so its gradient is summed over "
    "the ranks."
)
_FLOPS_FIX = "flops(batch) counts the work of all ranks together: it must not depend on the parallel layout."
_REFUSAL_FIX = (
    "A layout the layer cannot split must be refused by the config's check_tensor_parallel(n) (naming the field and "
    "the layout): blockzoo calls it before a run starts and before the layer is built."
)


def _check_parallel(job: _ParallelJob) -> None:
    """On every rank: each case split between `job.tensor_parallel` ranks against the single-process layer."""
    size = job.tensor_parallel

    def layout(**parallel: Any) -> Distributed:
        # The first one starts the process group; the later one lays out the same ranks differently.
        return Distributed(
            DistributedConfig(seed=job.seed, backend="gloo", timeout=60, tensor_parallel=size, **parallel)
        )

    problems: list[tuple[str, ...]] = []  # (problem, what to fix, ...)
    with layout() as distributed:
        needed = any(case.sequence_tensor_parallel for case in job.cases)
        sequence_parallel = layout(sequence_tensor_parallel=True) if needed else None
        for case in job.cases:
            label = f"{case.name}: tensor_parallel={size}"
            reference = build(case.implementation, case.config, job.hidden_size, single_process(job.seed))
            problems += _parallel_problems(job, case, distributed, reference, label)
            if case.sequence_tensor_parallel:
                label_sequence = f"{label} with sequence_tensor_parallel"
                problems += _parallel_problems(job, case, sequence_parallel, reference, label_sequence)
            if case.generation:
                layer = build(case.implementation, case.config, job.hidden_size, distributed)
                found = decoding_problems(
                    layer, reference, job.tolerance, DECODING_LENGTHS, DECODING_STEPS, torch.float32, seed=0
                )
                problems += [(f"{label}: {problem}", DECODING_FIX) for problem in found]
        for refusal in job.refused:
            if problem := _refusal_problem(refusal, job.hidden_size, distributed):
                problems.append((f"tensor_parallel={size}: {problem}", _REFUSAL_FIX))
    if problems:
        lines = dict.fromkeys(problem for problem, *_ in problems)
        fixes = dict.fromkeys(fix for _, *found_fixes in problems for fix in found_fixes)
        raise ConformanceError("\n".join([*lines, "What to fix:", *fixes]))


def _parallel_problems(
    job: _ParallelJob, case: CheckedCase, distributed: Distributed, reference: Layer, label: str
) -> list[tuple[str, ...]]:
    """(problem, what to fix, ...) tuples. Every rank takes the same path whatever it finds: the gathers are
    collectives."""
    fix = _SEQUENCE_PARALLEL_FIX if distributed.sequence_tensor_parallel else _TENSOR_PARALLEL_FIX
    try:
        layer = build(case.implementation, case.config, job.hidden_size, distributed)
    except Exception as error:  # noqa: BLE001
        return [(f"{label}: building the layer failed: {type(error).__name__}: {error}", fix)]
    group, rank = distributed.tensor_group, distributed.tensor_rank

    def own(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.chunk(distributed.tensor_size)[rank] if distributed.sequence_tensor_parallel else tensor

    hidden, weights = layer_inputs(sum(job.lengths), job.hidden_size)
    expected = run_layer(reference, hidden, Batch(job.lengths), weights)
    try:
        found = run_layer(layer, own(hidden), Batch(job.lengths), own(weights))
    except Exception as error:  # noqa: BLE001
        return [(f"{label}: the forward or backward pass failed: {type(error).__name__}: {error}", fix)]
    distributed.reduce_replicated_gradients(layer.parameters())
    problems = []
    for what, actual, wanted in (
        ("the output", found.output, own(expected.output)),
        ("the input gradient", found.input_grad, own(expected.input_grad)),
    ):
        if problem := mismatch(actual, wanted, job.tolerance, f"{label}: {what} on rank {rank}"):
            problems.append((f"{problem} from one process", fix))
    reference_parameters = dict(reference.named_parameters())
    names = [name for name, _ in layer.named_parameters()]
    if missing := [name for name in reference_parameters if name not in names]:
        problems.append((f"{label}: the split layer lacks the parameters {', '.join(missing)} of one process", fix))
    for name, parameter in layer.named_parameters():
        meta = getattr(parameter, "meta", None)
        if meta is None or name not in reference_parameters:
            problems.append((f"{label}: parameter {name!r} was not made by create_parameter / Linear", _SHARD_FIX))
            continue
        gradient = parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)
        full_value, full_gradient = (
            meta.local_to_global(parameter.detach(), group),
            meta.local_to_global(gradient, group),
        )
        wanted = reference_parameters[name]
        if full_value.shape != wanted.shape or not torch.equal(full_value, wanted.detach()):
            problems.append(
                (f"{label}: the ranks' shards of {name!r} differ from the single-process weight", _SHARD_FIX)
            )
        elif name in expected.grads and (
            problem := mismatch(
                full_gradient, expected.grads[name], job.tolerance, f"{label}: the gradient of {name!r}"
            )
        ):
            problems.append((f"{problem} from one process", fix, _GRADIENT_FIX))
    parallel_flops, single_flops = layer.flops(Batch(job.lengths)), reference.flops(Batch(job.lengths))
    if parallel_flops != single_flops:
        problems.append(
            (f"{label}: flops(batch) is {parallel_flops} on rank {rank}, {single_flops} on one process", _FLOPS_FIX)
        )
    return problems


def _refusal_problem(refusal: _Refusal, hidden_size: int, distributed: Distributed) -> str | None:
    what, pattern = refusal.label, refusal.pattern
    try:
        build(refusal.implementation, refusal.config, hidden_size, distributed)
    except ValueError as error:
        return (
            None if re.search(pattern, str(error)) else f"{what} was refused with {error!r}, not matching {pattern!r}"
        )
    except Exception as error:  # noqa: BLE001
        return f"{what} failed with {type(error).__name__}: {error}, not a ValueError matching {pattern!r}"
    return f"{what} was built; it should be refused with a ValueError matching {pattern!r}"
