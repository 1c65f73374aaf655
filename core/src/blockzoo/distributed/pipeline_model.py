"""A pipeline rank's part of the model (`build_pipeline_model`): the whole model built on the meta device, this rank's
stages kept and allocated, every other part a `RemotePart` that holds no parameters but still reports its FLOPs.
Parameter names stay those of the whole model, so checkpoints hold global tensors keyed as always. How the stages
run is `pipeline.py`."""

from __future__ import annotations

from typing import Any

from torch import nn

from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.base import Batch
from blockzoo.layers.parameter import initialize_parameter, materialize, on_meta_device
from blockzoo.model.config import ModelConfig
from blockzoo.model.language_model import LanguageModel
from blockzoo.peft.apply import is_adapter_parameter

# The name of the tied output weight's copy on the last stage (it is the first stage's embedding table).
TIED_COPY = "embeddings.word_embeddings"


def local_stages(distributed: Distributed) -> list[int]:
    """The stages this pipeline rank runs: s with s % pipeline_parallel == its rank (looped placement)."""
    config = distributed.config
    rank = distributed.pipeline_rank
    return [stage for stage in range(config.pipeline_stages) if stage % config.pipeline_parallel == rank]


class RemotePart(nn.Module):
    """Stands in for a part of the model that another pipeline stage holds: no parameters, but the part's FLOPs."""

    def __init__(self, name: str, stage: int, part: nn.Module | None = None):
        super().__init__()
        self.part_name, self.stage = name, stage
        self._part = (part,)  # in a tuple: not a submodule, so its (meta) parameters are not this model's

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{self.part_name} is held by pipeline stage {self.stage}, not by this process: a pipelined model runs "
            "through blockzoo.distributed.pipeline.Pipeline"
        )

    def flops(self, batch: Batch) -> tuple[int, int]:
        return self._part[0].flops(batch)


class TiedCopy(nn.Module):
    """The last stage's copy of a tied embedding table, under the embedding's name (`TIED_COPY`)."""

    def __init__(self, word_embeddings: nn.Parameter):
        super().__init__()
        self.word_embeddings = word_embeddings


def build_pipeline_model(config: ModelConfig, distributed: Distributed) -> LanguageModel:
    """The model with only this pipeline rank's stages allocated (and initialized, unless `uninitialized()`)."""
    with on_meta_device():
        model = LanguageModel(config, distributed)
    stage_blocks = distributed.config.stage_blocks(len(model.decoder))
    stages = local_stages(distributed)
    last = len(stage_blocks) - 1
    for stage, blocks in enumerate(stage_blocks):
        if stage not in stages:
            for index in blocks:
                model.decoder[index] = RemotePart(f"decoder.{index}", stage, model.decoder[index])
    if 0 not in stages:
        tied = config.tied_embedding_weight and last in stages
        model.embeddings = TiedCopy(model.embeddings.word_embeddings) if tied else RemotePart("embeddings", 0)
    if last not in stages:
        model.head = RemotePart("head", last)
    materialize(model, distributed)
    # PEFT adapters are initialized even inside `uninitialized()` (a base checkpoint does not hold them), which
    # `apply_peft` could not do on the meta device: here (seeded by name, the values of the single process).
    for name, parameter in model.named_parameters():
        if is_adapter_parameter(name) and not parameter.is_meta:
            initialize_parameter(parameter, distributed)
    return model
