"""A run's checkpoints: `step_<N>` in its output directory, the older ones pruned to `training.checkpoint_keep`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from blockzoo.checkpoint import ORIGIN_DIRECTORY, keep_last, save_checkpoint
from blockzoo.training.random_state import random_states
from blockzoo.training.setup import RunSetup


def save_run_checkpoint(setup: RunSetup, step: int, data_position: Any) -> Path:
    """Save the run at `step` (every rank), then prune (rank 0). A tensor that is not finite: `NonFiniteError`, with
    nothing written."""
    config, model = setup.run_config.training, setup.model
    output_dir = Path(config.output_dir)
    directory = output_dir / f"step_{step}"
    save_checkpoint(
        directory,
        model=model,
        optimizer=setup.optimizer,
        run_config=setup.run_config,
        step=step,
        distributed=setup.distributed,
        data_state=data_position,
        extra={"random_states": random_states(model, setup.distributed)},
        origin=model.origin,
        keep=config.checkpoint_keep,
        log=setup.log,
        base=setup.base,
    )
    if model.origin is not None:  # the newest copies: the checkpoints holding older ones may be pruned
        model.origin = attrs.evolve(model.origin, directory=directory / ORIGIN_DIRECTORY)
    if setup.distributed.rank == 0:
        keep_last(output_dir, config.checkpoint_keep)
    setup.log(f"saved checkpoint {directory}")
    return directory
