"""The built-in initializations (kind `initialization`): fill a tensor in place from a generator.

Each is registered by the core plugin against its config class; the parameter factory looks the
function up through the registry, so plugins can add their own with the same signature:
`(tensor, config, generator) -> None`.
"""

from __future__ import annotations

import torch

from blockzoo.layers.config import FillInitializationConfig, NormalInitializationConfig, UniformInitializationConfig


@torch.no_grad()
def initialize_normal(tensor: torch.Tensor, config: NormalInitializationConfig, generator: torch.Generator) -> None:
    """Normal(mean, std); with `truncate`, the normal truncated to mean ± truncate·std."""
    if config.truncate is None:
        tensor.normal_(config.mean, config.std, generator=generator)
    else:
        bound = config.truncate * config.std
        torch.nn.init.trunc_normal_(
            tensor, config.mean, config.std, config.mean - bound, config.mean + bound, generator=generator
        )


@torch.no_grad()
def initialize_uniform(tensor: torch.Tensor, config: UniformInitializationConfig, generator: torch.Generator) -> None:
    tensor.uniform_(config.low, config.high, generator=generator)


@torch.no_grad()
def initialize_fill(tensor: torch.Tensor, config: FillInitializationConfig, generator: torch.Generator) -> None:
    tensor.fill_(config.value)
