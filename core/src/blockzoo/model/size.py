"""Refuse a run this machine cannot hold, before allocating it: the model is built on the meta device (no memory)
and its parameters counted, and a step's token batches and one hidden state estimated from the config.

The estimates are lower bounds (no gradients, optimizer state or activations beyond one hidden state): a run they
refuse cannot fit; a run they pass may still run out of memory later.
"""

from __future__ import annotations

import os
import re

import torch
from torch import nn

from blockzoo.config import ConfigError
from blockzoo.distributed.runtime import Distributed
from blockzoo.layer_errors import locate_layer_failure
from blockzoo.layers.parameter import ParameterShapeError, on_meta_device
from blockzoo.model.config import ModelConfig
from blockzoo.run_config import RunConfig

# Bytes per token of a step's batches, all held at once (tokens, labels, positions: int64 each).
_BATCH_BYTES_PER_TOKEN = 3 * 8


def meta_model(config: ModelConfig, distributed: Distributed) -> nn.Module:
    """The model built on the meta device (no memory, no initialization); a layer refusing its config, or a tensor
    too large to index, is a `ConfigError` at `model`."""
    from blockzoo.model.language_model import LanguageModel

    try:
        with on_meta_device():
            return LanguageModel(config, distributed)
    except ParameterShapeError as error:  # the config's sizes, whichever layer asked: no plugin is to blame
        raise ConfigError([("model", f"cannot be built: {error}")]) from None
    except (ValueError, RuntimeError, MemoryError) as error:
        failure = locate_layer_failure(error)  # a plugin's layer: named, with its path and where it raised
        if (allocation := _allocation_failure(failure.error if failure else error)) is not None:
            where = f"the {failure.entry.kind} at {failure.path}" if failure else "a layer"
            raise ConfigError([("model", f"cannot be built: {where} {allocation}")]) from None
        raise ConfigError([("model", f"cannot be built: {failure.message() if failure else error}")]) from None


def _allocation_failure(error: BaseException) -> str | None:
    """What a layer asked of the memory while it was built (constants it computes at once: rotary tables, ...), in
    words, when the allocator refused it; None for any other error."""
    text = str(error)
    if not isinstance(error, MemoryError) and "can't allocate memory" not in text:
        return None
    asked = re.search(r"allocate (\d+) bytes", text)
    amount = f" {_gib(int(asked.group(1)))}" if asked else ""
    return (
        f"asks for{amount} of memory while being built, more than this machine can allocate: a size in its config is "
        "far too large"
    )


def local_parameter_bytes(model: nn.Module, distributed: Distributed) -> int:
    """Bytes of the parameters this rank allocates (its tensor-parallel shards; its pipeline stages only)."""
    keep = None
    if distributed.config.pipeline_parallel > 1:
        from blockzoo.distributed.pipeline import local_stages

        stage_blocks = distributed.config.stage_blocks(len(model.decoder))
        stages = local_stages(distributed)
        keep = {f"decoder.{index}." for stage in stages for index in stage_blocks[stage]}
        keep |= {"embeddings."} if 0 in stages else set()
        keep |= {"head."} if len(stage_blocks) - 1 in stages else set()
    total = 0
    for name, parameter in model.named_parameters():  # tied parameters once
        if keep is None or any(name.startswith(prefix) for prefix in keep):
            total += parameter.numel() * parameter.element_size()
    return total


def device_memory(device: torch.device) -> int:
    """The device's total memory in bytes (a CUDA device's, else the machine's physical memory)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(run_config: RunConfig, distributed: Distributed, *, training: bool = True) -> int:
    """Refuse (a `ConfigError` naming the fields) a run whose parameters alone, or (when `training`) whose step's
    token batches or one micro-batch's hidden state, exceed the memory of this rank's device. Returns the bytes of
    this rank's parameters."""
    if run_config.model.pretrained is not None:  # the checkpoint's architecture (its config: a small file)
        from blockzoo.model.factory import with_pretrained_config

        run_config = with_pretrained_config(run_config, run_config.model.pretrained)
    memory = device_memory(distributed.device)
    where = f"{distributed.device.type} memory ({_gib(memory)})"
    model = meta_model(run_config.model, distributed)
    parameters = local_parameter_bytes(model, distributed)
    if parameters > memory:
        raise ConfigError(
            [("model", f"its parameters alone take {_gib(parameters)} on this rank, more than this machine's {where}")]
        )
    if not training:
        return parameters
    data, steps = run_config.data, run_config.training.gradient_accumulation
    tokens = data.micro_batch_size * data.sequence_length
    micro_batch = tokens * (_BATCH_BYTES_PER_TOKEN + run_config.model.hidden_size * 4)
    if micro_batch > memory:
        raise ConfigError(
            [
                (
                    "data.micro_batch_size",
                    f"a micro-batch of data.micro_batch_size × data.sequence_length = {tokens} tokens takes "
                    f"{_gib(micro_batch)} for its tokens and one hidden state (model.hidden_size "
                    f"{run_config.model.hidden_size}, fp32), more than this machine's {where}",
                )
            ]
        )
    if tokens * steps * _BATCH_BYTES_PER_TOKEN > memory:
        raise ConfigError(
            [
                (
                    "training.gradient_accumulation",
                    f"a step's {steps} micro-batches of {tokens} tokens are read at once and take "
                    f"{_gib(tokens * steps * _BATCH_BYTES_PER_TOKEN)}, more than this machine's {where}",
                )
            ]
        )
    return parameters


def _gib(size: int) -> str:
    return f"{size / 2**30:,.1f} GiB"
