"""Evaluation during training: the sets an evaluation reads (checked before any step) and the loss of one."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import attrs
import torch
from torch import nn

from blockzoo.data.dataset import Dataset, build_dataset
from blockzoo.data.errors import DatasetError
from blockzoo.distributed.data_parallel import reshard
from blockzoo.distributed.pipeline import Pipeline
from blockzoo.distributed.runtime import Distributed
from blockzoo.run_config import RunConfig
from blockzoo.training.config import TrainingConfig
from blockzoo.training.gradients import StepReductions
from blockzoo.training.step import place_micro_batch, to_host


def data_rank(distributed: Distributed) -> dict[str, int]:
    """Where this rank reads the data: the tensor-parallel ranks of one data-parallel rank read the same."""
    return {"rank": distributed.data_rank, "ranks": distributed.data_size}


def build_evaluation_sets(
    run_config: RunConfig, data: Dataset, distributed: Distributed, log: Callable[[str], None]
) -> dict[str, Dataset]:
    """What each evaluation reads, by the name its loss is logged under: `evaluation_loss` (the data's held-out
    split) and `evaluation_loss/<name>` (`training.evaluation.datasets`). A set that cannot be evaluated (missing,
    empty, too small for a micro-batch on every data rank) is refused before any step, naming it."""
    evaluation = run_config.training.evaluation
    if evaluation.interval is None:
        return {}
    run_data, seed = run_config.data, run_config.distributed.seed
    sets: dict[str, Dataset] = {}
    # The data's own split: when it holds one, or when it is all there is to evaluate (then its error is the one).
    if not evaluation.datasets or data.num_evaluation_samples != 0:
        sets["evaluation_loss"] = data
    for name, config in evaluation.datasets.items():
        where = f"training.evaluation.datasets.{name}"
        given = config.explicit_fields()
        shape = {key: getattr(run_data, key) for key in ("sequence_length", "micro_batch_size") if key not in given}
        try:
            sets[f"evaluation_loss/{name}"] = build_dataset(
                attrs.evolve(config, **shape),
                seed=seed,
                model_vocab_size=run_config.model.embeddings.vocab_size,
                log=log,
                training=False,
            )
        except DatasetError as error:
            raise DatasetError(f"{where}: {error}") from None
    for key, dataset in sets.items():
        try:
            dataset.evaluation_batches(**data_rank(distributed))
        except DatasetError as error:
            if dataset is data:
                raise DatasetError(
                    f"training.evaluation.interval is {evaluation.interval}, but {error}; or turn evaluation "
                    "off: training.evaluation.interval=null"
                ) from None
            raise DatasetError(f"training.evaluation.datasets.{key.split('/', 1)[1]}: {error}") from None
    return sets


@torch.no_grad()
def evaluate(
    model: nn.Module,
    pipeline: Pipeline | None,
    distributed: Distributed,
    sets: dict[str, Dataset],
    config: TrainingConfig,
) -> dict[str, float]:
    """The loss of each evaluation set (`build_evaluation_sets`) over its first `training.evaluation.iters`
    micro-batches (or all it holds), by the name the metrics file gives it."""
    model.eval()
    iters = config.evaluation.iters
    losses = [evaluation_loss(dataset, model, pipeline, distributed, iters) for dataset in sets.values()]
    figures = dict(zip(sets, to_host(losses)))
    for module in [model] if pipeline is None else pipeline.modules:
        reshard(module)  # the forward passes without a backward left weights gathered
    model.train()
    return figures


def evaluation_loss(
    dataset: Dataset, model: nn.Module, pipeline: Pipeline | None, distributed: Distributed, iters: int | None
) -> torch.Tensor:
    """The mean cross-entropy of a set's first `iters` micro-batches over every data rank (on the device)."""
    reductions = StepReductions(distributed)
    device = distributed.device
    total, count = torch.zeros((), device=device), torch.zeros((), device=device)
    batches = dataset.evaluation_batches(**data_rank(distributed))
    placed = [place_micro_batch(micro, distributed) for micro in itertools.islice(batches, iters)]
    if pipeline is not None:  # through the stages, forward only
        total = pipeline.evaluate(placed)
    else:
        for micro in placed:
            cross_entropy, _ = model.loss(micro.tokens, micro.labels, micro.batch)
            total += cross_entropy.float()
    count = sum((micro.labelled() for micro in placed), count)
    return reductions.loss(total) / reductions.over_data(count).clamp(min=1)
