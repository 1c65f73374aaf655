"""Implementations of the SSM initialization types of `blockzoo_ssm.config` (registered by the core's plugin)."""

from __future__ import annotations

import math

import torch

from blockzoo_ssm.config import (
    ALogRangeInitializationConfig,
    ALogStateInitializationConfig,
    DtBiasInitializationConfig,
)


@torch.no_grad()
def initialize_dt_bias(tensor: torch.Tensor, config: DtBiasInitializationConfig, generator: torch.Generator) -> None:
    uniform = torch.rand(tensor.shape, generator=generator, dtype=torch.float64)
    dt = torch.exp(uniform * (math.log(config.max) - math.log(config.min)) + math.log(config.min))
    dt = dt.clamp(min=config.floor)
    # softplus⁻¹(dt) = log(exp(dt) - 1), written so it stays accurate for small dt.
    tensor.copy_(dt + torch.log(-torch.expm1(-dt)))


@torch.no_grad()
def initialize_a_log_range(
    tensor: torch.Tensor, config: ALogRangeInitializationConfig, generator: torch.Generator
) -> None:
    uniform = torch.rand(tensor.shape, generator=generator, dtype=torch.float64)
    tensor.copy_(torch.log(config.low + uniform * (config.high - config.low)))


@torch.no_grad()
def initialize_a_log_state(
    tensor: torch.Tensor, config: ALogStateInitializationConfig, generator: torch.Generator
) -> None:
    if tensor.ndim == 0:
        raise ValueError("a_log_state initializes along the last dimension (the state); got a scalar tensor")
    tensor.copy_(torch.log(torch.arange(1, tensor.shape[-1] + 1, dtype=torch.float64)).expand(tensor.shape))
