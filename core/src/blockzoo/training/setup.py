"""Setting a training run up, before its first step: everything `Trainer` receives (`RunSetup`), made by `prepare_run`.

In order: the latest readable checkpoint of the output directory is looked up (once: a corrupted newer one is skipped,
and said); the pretrained start (`model.pretrained`) gives the model's config, unless the run resumes (its latest
checkpoint has the config to start from); the ranks check they agree; the model is built (this rank's pipeline
stages), its weights coming from the PEFT base, the pretrained checkpoint or the latest checkpoint; then the
pipeline, the parallel layout (recomputation, compilation, ZeRO), the optimizer, the CUDA graphs, the data, the
evaluation sets and benchmark, and last the resumed state (weights, optimizer state, data position, random states).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from blockzoo.benchmarks.run import HarnessRunner
from blockzoo.checkpoint import (
    METADATA_FILE,
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint_metadata,
    read_origin,
)
from blockzoo.conversion import get_format
from blockzoo.data.dataset import Dataset, build_dataset
from blockzoo.data.errors import DatasetError
from blockzoo.distributed import debug
from blockzoo.distributed.consistency import check_ranks_agree
from blockzoo.distributed.parallelize import parallelize
from blockzoo.distributed.pipeline import Pipeline, build_pipeline_model
from blockzoo.distributed.runtime import Distributed
from blockzoo.errors import UsageError
from blockzoo.layers.parameter import uninitialized
from blockzoo.model.language_model import LanguageModel
from blockzoo.model.peft_base import base_reference, load_base
from blockzoo.model.pretrained import load_pretrained_weights, pretrained_origin, with_pretrained_config
from blockzoo.model.tokenizer import model_tokenizer
from blockzoo.plugins import get_registry
from blockzoo.run_config import RunConfig
from blockzoo.training.evaluation import build_evaluation_sets, data_rank
from blockzoo.training.gradients import GradientNorm
from blockzoo.training.graphs import check_cuda_graphs_possible
from blockzoo.training.optimizer import unique_trainable
from blockzoo.training.random_state import restore_random_states
from blockzoo.training.reporting import memory_report, memory_usage


@attrs.define
class RunSetup:
    """A run ready for its first (or next) step: what `prepare_run` made, for `Trainer` to run."""

    run_config: RunConfig  # with the pretrained checkpoint's (or the resumed checkpoint's) model
    distributed: Distributed
    owns_distributed: bool  # made by `prepare_run`: the trainer shuts it down
    log: Callable[[str], None]  # on rank 0 only
    model: nn.Module
    pipeline: Pipeline | None
    optimizer: torch.optim.Optimizer
    trainable: list[nn.Parameter]  # walked once, not per step: a small model's step is bound by the host's work
    gradient_norm: GradientNorm
    memory: Any
    debug: Any
    data: Dataset
    evaluation_sets: dict[str, Dataset]
    harness: HarnessRunner | None
    # The base a PEFT run's checkpoints refer to instead of holding its weights (None: they hold every weight).
    base: dict[str, Any] | None
    resumed_from: Path | None
    resumed_base: dict[str, Any] | None  # the base of `resumed_from` when it holds adapters only
    step: int = 0
    data_position: Any = None


def prepare_run(
    run_config: RunConfig,
    *,
    distributed: Distributed | None = None,
    log: Callable[[str], None],
) -> RunSetup:
    """Set the run of `run_config` up (every rank calls it). `log` hears rank 0's messages; a `Distributed` made here
    is the result's to shut down (`owns_distributed`)."""
    output_dir = Path(run_config.training.output_dir)
    owns_distributed = distributed is None
    distributed = distributed or Distributed(run_config.distributed)

    def log_rank_0(message: str) -> None:
        if distributed.rank == 0:
            log(message)

    last = latest_checkpoint(output_dir, report=log_rank_0)  # a corrupted newer one is skipped, and said
    source = run_config.model.pretrained
    # Resuming, the latest checkpoint has the weights, and its config is the one to start from.
    pretrained = None if source is None or last is not None else source
    if source is not None:
        run_config = with_pretrained_config(run_config, last or source)
    config = run_config.training
    check_ranks_agree(run_config, distributed)  # different versions, plugins or configs refuse to start
    if config.export_format is not None:  # refuse a model the format cannot hold before training it
        get_format(config.export_format).check_model_config(run_config.model)
    torch.manual_seed(run_config.distributed.seed)
    with uninitialized(pretrained is not None or last is not None):  # the checkpoint has every weight
        if run_config.distributed.pipeline_parallel > 1:  # this rank's stages only
            model = build_pipeline_model(run_config.model, distributed)
        else:
            model = LanguageModel(run_config.model, distributed)
    # The base of the latest checkpoint when it holds a PEFT fine-tuning's adapters only.
    resumed_base = read_checkpoint_metadata(last).get("base") if last else None
    base = _load_initial_weights(model, run_config, distributed, pretrained, last, resumed_base, log_rank_0)
    pipeline = Pipeline(model, distributed) if run_config.distributed.pipeline_parallel > 1 else None
    parallelize(model, run_config, None if pipeline is None else pipeline.modules)  # new parameter objects
    debug_hooks = debug.install(model, distributed) if run_config.distributed.debug else None
    optimizer = get_registry().implementation_of(config.optimizer)(config.optimizer, model.parameters())
    trainable = unique_trainable(model.parameters())
    if config.cuda_graphs:  # the trainer captures its steps (`StepGraph`)
        problem = check_cuda_graphs_possible(distributed.device, distributed.world_size)
        if problem is not None:
            raise UsageError(problem)
    memory = memory_usage(model, optimizer, run_config.distributed.zero_stage)
    log_rank_0(memory_report(memory, distributed))
    data = build_dataset(
        run_config.data,
        seed=run_config.distributed.seed,
        model_vocab_size=run_config.model.embeddings.vocab_size,
        log=log_rank_0,
    )
    setup = RunSetup(
        run_config=run_config,
        distributed=distributed,
        owns_distributed=owns_distributed,
        log=log_rank_0,
        model=model,
        pipeline=pipeline,
        optimizer=optimizer,
        trainable=trainable,
        gradient_norm=GradientNorm(model, distributed, pipeline),
        memory=memory,
        debug=debug_hooks,
        data=data,
        evaluation_sets={},
        harness=None,
        base=base,
        resumed_from=last,
        resumed_base=resumed_base,
    )
    setup.evaluation_sets = build_evaluation_sets(run_config, data, distributed, log_rank_0)
    setup.harness = _harness_runner(setup)
    if last is not None:
        _resume(setup, last)
    return setup


def _load_initial_weights(
    model: nn.Module,
    run_config: RunConfig,
    distributed: Distributed,
    pretrained: str | None,
    last: Path | None,
    resumed_base: dict[str, Any] | None,
    log: Callable[[str], None],
) -> dict[str, Any] | None:
    """The weights a run starts from besides the latest checkpoint's: a PEFT base (the latest checkpoint holds
    adapters only), or the pretrained checkpoint's. Returns the base the run's checkpoints are to refer to (a resumed
    run keeps its checkpoints' kind, unless `checkpoint_base_weights` now asks for every weight)."""
    if resumed_base:  # the latest holds adapters only: the base weights from its base (if unchanged)
        load_base(model, last, resumed_base, distributed)
    base = None if run_config.training.checkpoint_base_weights else resumed_base
    if pretrained is not None:
        if run_config.model.peft is not None and not run_config.training.checkpoint_base_weights:
            base = base_reference(pretrained)
        load_pretrained_weights(model, pretrained, distributed)
        model.origin = pretrained_origin(pretrained)
        log(f"initialized from {pretrained}")
    return base


def _harness_runner(setup: RunSetup) -> HarnessRunner | None:
    """The benchmark of `training.evaluation.harness`, built (and its tasks checked) before any step."""
    config = setup.run_config.training.evaluation.harness
    if config is None:
        return None
    tokenizer, stop = model_tokenizer(setup.model, setup.run_config, dataset=setup.data, purpose="run benchmarks")
    return HarnessRunner(config, tokenizer, setup.distributed, stop_tokens=stop)


def _resume(setup: RunSetup, last: Path) -> None:
    """Continue from the checkpoint `last`: its weights, optimizer state, step, data position and random states."""
    _, metadata = load_checkpoint(
        last,
        model=setup.model,
        optimizer=setup.optimizer,
        distributed=setup.distributed,
        model_source="the model of the run config",
        base_loaded=bool(setup.resumed_base),
    )
    setup.step = int(metadata["step"])
    setup.data_position = metadata.get("data")
    try:  # a bad position is the metadata's fault
        setup.data.training_batches(**data_rank(setup.distributed), position=setup.data_position)
    except DatasetError as error:
        raise CheckpointError(last / METADATA_FILE, f"`data`: {error}") from None
    setup.model.origin = read_origin(last)
    extra = metadata.get("extra") or {}
    problem = restore_random_states(setup.model, setup.distributed, extra.get("random_states"))
    if problem is not None:
        setup.log(f"random states not restored ({problem}): random draws differ from a run that did not stop")
    setup.log(f"resumed from {last} (step {setup.step})")
