"""The optimizer and the learning-rate schedule.

Parameters are grouped by their effective learning-rate scale and weight-decay flag (`param.meta`);
frozen ones (scale 0) are left out. A concatenated parameter whose components differ (key‖value with
two lr_scales) takes a step with scale 1 and full weight decay, and its update is then rescaled per
row, which is exactly AdamW with per-row settings.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from blockzoo.errors import UsageError
from blockzoo.training.config import AdamWConfig, ScheduleConfig


class AdamW(torch.optim.AdamW):
    def __init__(self, config: AdamWConfig, parameters: Iterable[nn.Parameter]):
        self.config = config
        groups: dict[tuple[float, bool], list[nn.Parameter]] = {}
        self.per_row: list[nn.Parameter] = []
        for parameter in unique_trainable(parameters):
            meta = parameter.meta
            if meta.uniform:
                key = (meta.settings[0].lr_scale, meta.settings[0].weight_decay)
            else:
                key = (1.0, True)
                self.per_row.append(parameter)
            groups.setdefault(key, []).append(parameter)
        if not groups:
            raise UsageError("no parameter is trainable: every effective lr_scale is 0 (model.lr_scale, ...)")
        param_groups = [
            {
                "params": params,
                "lr": config.learning_rate * lr_scale,
                "lr_scale": lr_scale,
                "weight_decay": config.weight_decay if decay else 0.0,
            }
            for (lr_scale, decay), params in groups.items()
        ]
        super().__init__(
            param_groups,
            lr=config.learning_rate,
            betas=(config.beta_1, config.beta_2),
            eps=config.epsilon,
            foreach=True,
        )

    def set_learning_rate(self, learning_rate: float) -> None:
        for group in self.param_groups:
            group["lr"] = learning_rate * group["lr_scale"]

    @torch.no_grad()
    def step(self, closure=None):
        before = [parameter.detach().clone() for parameter in self.per_row]
        result = super().step(closure)
        for parameter, old in zip(self.per_row, before):
            meta = parameter.meta
            lr_scale, decays = meta.lr_scale_rows().to(old.device), meta.weight_decay_rows().to(old.device)
            learning_rate = self.param_groups[0]["lr"] / self.param_groups[0]["lr_scale"]
            # The step applied `-lr·(wd·old + adam)`; scale it per row and take back the decay where it is off.
            update = (parameter - old) * lr_scale + lr_scale * learning_rate * self.config.weight_decay * (
                1 - decays
            ) * old
            parameter.copy_(old + update)
        return result


def unique_trainable(parameters: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """Trainable parameters, each once (tied weights appear twice in a module)."""
    seen: dict[int, nn.Parameter] = {}
    for parameter in parameters:
        if parameter.requires_grad:
            seen.setdefault(id(parameter), parameter)
    return list(seen.values())


def learning_rate(step: int, *, peak: float, train_iters: int, schedule: ScheduleConfig) -> float:
    """The learning rate of optimizer step `step` (0-based)."""
    if step < schedule.warmup_iters:
        return peak * (step + 1) / schedule.warmup_iters
    minimum = peak * schedule.minimum_learning_rate_ratio
    if schedule.decay == "constant":
        return peak
    # Progress runs from 0 at the first step after the warmup to 1 at the last step.
    decay_steps = max(train_iters - schedule.warmup_iters - 1, 1)
    progress = min((step - schedule.warmup_iters) / decay_steps, 1.0)
    if schedule.decay == "linear":
        return peak - (peak - minimum) * progress
    return minimum + (peak - minimum) * 0.5 * (1 + math.cos(math.pi * progress))
