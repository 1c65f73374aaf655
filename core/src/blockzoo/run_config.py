"""The top-level config of a run (`blockzoo train CONFIG`). Torch-free."""

from __future__ import annotations

from collections.abc import Iterator

import attrs

from blockzoo.config import Config, ConfigFieldError, check, configclass, field, structure
from blockzoo.data.config import DatasetConfig
from blockzoo.distributed.config import DistributedConfig
from blockzoo.layers.config import (
    SEQUENCE_DATA_PARALLEL,
    SEQUENCE_TENSOR_PARALLEL,
    TENSOR_PARALLEL,
    MixerConfig,
    MLPConfig,
)
from blockzoo.model.config import FixedBlockSequenceConfig, ModelConfig, PatternBlockSequenceConfig
from blockzoo.training.config import TrainingConfig


@configclass
class RunConfig(Config):
    model: ModelConfig = field(factory=ModelConfig, doc="The model to build.")
    distributed: DistributedConfig = field(factory=DistributedConfig, doc="Parallel layout and numerics.")
    data: DatasetConfig = field(
        factory=lambda: structure({}, DatasetConfig, root="data"), doc="Training and evaluation data."
    )
    training: TrainingConfig = field(factory=TrainingConfig, doc="Optimizer, schedule, loop, checkpoints.")

    def __attrs_post_init__(self) -> None:
        names = {name for name, _ in self.model.decoder.expanded_blocks()}
        for name in self.training.recompute_blocks:
            check(
                name in names,
                f"training.recompute_blocks.{name}",
                f"the model has no block named {name!r} (its blocks: {', '.join(sorted(names))})",
            )
        self.distributed.check_pipeline(len(self.model.decoder.expanded_blocks()), self.training.gradient_accumulation)
        if self.distributed.uses_slices:
            self._check_slices()
        # Refuse a layout a layer cannot run before anything is built.
        needed = {
            TENSOR_PARALLEL: (self.distributed.tensor_parallel > 1, "distributed.tensor_parallel"),
            SEQUENCE_TENSOR_PARALLEL: (
                self.distributed.uses_sequence_tensor_parallel,
                "distributed.sequence_tensor_parallel",
            ),
            SEQUENCE_DATA_PARALLEL: (
                self.distributed.uses_slices,
                "distributed.sequence_data_parallel"
                if self.distributed.sequence_data_parallel > 1
                else "distributed.micro_sequence_length",
            ),
        }
        for path, layer in _mixers_and_mlps(self.model):
            if self.distributed.tensor_parallel > 1 and TENSOR_PARALLEL in layer.capabilities:
                try:
                    layer.check_tensor_parallel(self.distributed.tensor_parallel)
                except ConfigFieldError as error:
                    raise ConfigFieldError(f"{path}.{error.field_name}", error.message) from None
            if self.distributed.uses_slices and SEQUENCE_DATA_PARALLEL in layer.capabilities:
                try:
                    layer.check_sequence_data_parallel()
                except ConfigFieldError as error:
                    raise ConfigFieldError(f"{path}.{error.field_name}", error.message) from None
            for capability, (used, setting) in needed.items():
                if used and capability not in layer.capabilities:
                    from blockzoo.plugins import get_registry

                    name = get_registry().name_of(type(layer))
                    raise ConfigFieldError(
                        path, f"{layer.kind} type {name!r} does not support {capability.replace('_', '-')} ({setting})"
                    )

    def _check_slices(self) -> None:
        """Refuse what slices of sequences cannot do with the rest of the run, naming the fields."""
        distributed = self.distributed
        distributed.check_micro_batch_tokens(self.data.micro_batch_size * self.data.sequence_length)
        setting = (
            "distributed.sequence_data_parallel"
            if distributed.sequence_data_parallel > 1
            else "distributed.micro_sequence_length"
        )
        check(
            self.training.compile == "none",
            "training.compile",
            f"compiled blocks do not run slices of sequences yet ({setting}); use compile: none",
        )
        check(
            distributed.pipeline_parallel == 1 or distributed.micro_sequence_length is None,
            "distributed.micro_sequence_length",
            "micro-sequences do not run through pipeline stages; use pipeline_parallel: 1 or micro_sequence_length: "
            "null",
        )


def _mixers_and_mlps(model: ModelConfig) -> Iterator[tuple[str, MixerConfig | MLPConfig]]:
    """(path, config) of every mixer and MLP of the model's blocks, paths relative to the run config."""
    decoder = model.decoder
    if isinstance(decoder, FixedBlockSequenceConfig):
        blocks = {"model.decoder.block": decoder.block}
    elif isinstance(decoder, PatternBlockSequenceConfig):
        blocks = {f"model.decoder.blocks.{name}": block for name, block in decoder.blocks.items()}
    else:
        blocks = {f"model.decoder.{index}": block for index, (_, block) in enumerate(decoder.expanded_blocks())}
    for path, block in blocks.items():
        for attribute in attrs.fields(type(block)):
            value = getattr(block, attribute.name)
            if isinstance(value, (MixerConfig, MLPConfig)):
                yield f"{path}.{attribute.name}", value
            elif isinstance(value, dict):  # a parallel block's mixers, by name
                for name, part in value.items():
                    if isinstance(part, (MixerConfig, MLPConfig)):
                        yield f"{path}.{attribute.name}.{name}", part
