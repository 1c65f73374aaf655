"""The optimizer and the learning-rate schedule.

Parameters are grouped by their effective learning-rate scale and weight-decay flag (`param.meta`);
frozen ones (scale 0) are left out. A concatenated parameter whose components differ (key‖value with
two lr_scales) takes a step with scale 1 and full weight decay, and its update is then rescaled per
row, which is exactly AdamW with per-row settings (under ZeRO, the rows of this rank's shard).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from blockzoo.distributed.data_parallel import shard_rows
from blockzoo.distributed.runtime import local_tensor
from blockzoo.errors import UsageError
from blockzoo.training.config import AdamWConfig, ScheduleConfig


class AdamW(torch.optim.AdamW):
    """torch's AdamW over blockzoo's parameter groups: fused on CUDA and the CPU, foreach elsewhere.

    Under FSDP (ZeRO) the parameters are DTensors holding this rank's rows, and the state follows them; plain
    parameters (experts split by expert parallelism) get groups of their own, since torch's multi-tensor kernels
    take no mix of the two.
    """

    def __init__(self, config: AdamWConfig, parameters: Iterable[nn.Parameter]):
        self.config = config
        groups: dict[tuple[float, bool, bool], list[nn.Parameter]] = {}
        self.per_row: list[nn.Parameter] = []
        for parameter in unique_trainable(parameters):
            meta = parameter.meta
            if meta.uniform:
                key = (meta.settings[0].lr_scale, meta.settings[0].weight_decay)
            else:
                key = (1.0, True)
                self.per_row.append(parameter)
            groups.setdefault((*key, isinstance(parameter, DTensor)), []).append(parameter)
        if not groups:
            raise UsageError("no parameter is trainable: every effective lr_scale is 0 (model.lr_scale, ...)")
        param_groups = [
            {
                "params": params,
                "lr": config.learning_rate * lr_scale,
                "lr_scale": lr_scale,
                "weight_decay": config.weight_decay if decay else 0.0,
            }
            for (lr_scale, decay, _), params in groups.items()
        ]
        # Fused: one kernel per group on CUDA and the CPU (on a CPU, 6-8x faster than foreach).
        fused = all(parameter.device.type in ("cuda", "cpu") for group in param_groups for parameter in group["params"])
        super().__init__(
            param_groups,
            lr=config.learning_rate,
            betas=(config.beta_1, config.beta_2),
            eps=config.epsilon,
            **({"fused": True} if fused else {"foreach": True}),
        )
        # The fused kernels skip the whole update when given a non-finite flag (as under a gradient scaler), so a
        # step's check of its figures can wait until the update is queued. Not with per-row settings (their
        # correction applies after the kernel) nor DTensors (the flag is a plain tensor).
        self.skips_non_finite_on_device = fused and not self.per_row and not any(key[2] for key in groups)
        # The per-row settings of the rows each rank holds (its FSDP shard's), on its device once for all steps.
        self._rows = [
            (
                meta.lr_scale_rows()[shard_rows(parameter)].to(parameter.device),
                meta.weight_decay_rows()[shard_rows(parameter)].to(parameter.device),
            )
            for parameter, meta in ((parameter, parameter.meta) for parameter in self.per_row)
        ]

    def set_learning_rate(self, learning_rate: float) -> None:
        for group in self.param_groups:
            group["lr"] = learning_rate * group["lr_scale"]

    def state_bytes(self) -> int:
        """Bytes of the state of every parameter once allocated: two moments shaped like this rank's part of it,
        and a step count."""
        total = 0
        for group in self.param_groups:
            for parameter in group["params"]:
                local = local_tensor(parameter.detach())
                total += 2 * local.numel() * local.element_size() + 4
        return total

    def skip_unless_finite(self, *figures: torch.Tensor) -> None:
        """Make the next `step`, on the device, skip the update unless every figure is finite, and every later
        `step` once one was not (`skips_non_finite_on_device` only): the host may read the figures steps later, and
        the weights stay those from before the first non-finite one."""
        finite = torch.stack([torch.isfinite(figure.detach().float()).all() for figure in figures]).all()
        skip = (~finite).float()
        previous = getattr(self, "found_inf", None)
        self.found_inf = skip if previous is None else torch.maximum(previous, skip)

    @torch.no_grad()
    def step(self, closure=None):
        before = [local_tensor(parameter.detach()).clone() for parameter in self.per_row]
        result = super().step(closure)
        learning_rate = self.param_groups[0]["lr"] / self.param_groups[0]["lr_scale"]
        for parameter, old, (lr_scale, decays) in zip(self.per_row, before, self._rows):
            new = local_tensor(parameter.detach())
            # The step applied `-lr·(wd·old + adam)`; scale it per row and take back the decay where it is off.
            update = (new - old) * lr_scale + lr_scale * learning_rate * self.config.weight_decay * (1 - decays) * old
            new.copy_(old + update)
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
