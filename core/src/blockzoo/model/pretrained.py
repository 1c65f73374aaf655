"""The pretrained start: a model whose architecture and weights come from a checkpoint of any registered format
(`model.pretrained`). One step, `start_from_pretrained`, that `blockzoo.build` and the run set-up both take."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from blockzoo.config import merge, to_dict, update
from blockzoo.conversion import Origin
from blockzoo.model.native import checkpoint_format
from blockzoo.peft.apply import without_adapters
from blockzoo.run_config import RunConfig


def with_pretrained_config(run_config: RunConfig, source: str | Path) -> RunConfig:
    """`run_config` whose model is the checkpoint's at `source`, updated with the model fields `run_config` gives
    (`pretrained` consumed: None)."""
    given = to_dict(run_config.model, explicit_only=True)
    given.pop("pretrained", None)
    model = merge(pretrained_model_config(source), given)
    return update(run_config, {"model": {**model, "pretrained": None}})


def pretrained_model_config(source: str | Path) -> dict:
    """The model config (plain data) of a checkpoint of any format."""
    source = Path(source)
    return checkpoint_format(source).read_model_config(source)


def pretrained_origin(source: str | Path) -> Origin | None:
    """The origin files of a checkpoint of any format: a foreign checkpoint's own, a native one's copies."""
    source = Path(source)
    return checkpoint_format(source).origin(source)


def load_pretrained_weights(model: Any, source: str | Path, distributed: Any = None) -> None:
    """Fill `model`'s parameters (this rank's shards) from a checkpoint of any format (its base weights: the adapters
    of a fine-tuning model keep their fresh values)."""
    source, distributed = Path(source), distributed or model.distributed
    with without_adapters(model):
        checkpoint_format(source).load_weights(source, model, distributed)


def start_from_pretrained(model: Any, source: str | Path, distributed: Any = None) -> None:
    """Give `model` (built `uninitialized()` from `with_pretrained_config`) the weights (this rank's shards) and origin
    files of the checkpoint at `source`."""
    load_pretrained_weights(model, source, distributed)
    model.origin = pretrained_origin(source)
