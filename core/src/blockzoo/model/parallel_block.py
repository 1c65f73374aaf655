"""The `parallel` block: norm → several mixers side by side, outputs scaled and summed → residual → norm → MLP →
residual (Falcon-H1's attention ‖ Mamba 2).

Each mixer is any mixer plugin's, built as the decoder block builds its one mixer, under `mixers.<name>` (so its
parameter names are `decoder.N.mixers.<name>.…`, stable whatever the other mixers). Everything a mixer keeps is per
mixer: a generation state and a slice's carry are dicts name → that mixer's. Under tensor parallelism each mixer
reduces its own output (its row-parallel projection), so the sum needs no communication of its own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from blockzoo.distributed.runtime import Distributed
from blockzoo.layer_errors import LayerOutputError
from blockzoo.layers.base import Batch
from blockzoo.layers.config import scaled_lr
from blockzoo.layers.dims import TensorDim
from blockzoo.model.block import build_part, not_a_view, scaled
from blockzoo.model.config import ParallelBlockConfig


class ParallelBlock(nn.Module):
    def __init__(
        self,
        config: ParallelBlockConfig,
        *,
        name: str,
        hidden_dim: TensorDim,
        distributed: Distributed,
        lr_scale: float,
    ):
        super().__init__()
        lr_scale = scaled_lr(lr_scale, config.lr_scale)
        common = {"hidden_dim": hidden_dim, "distributed": distributed, "lr_scale": lr_scale}
        self.residual_multiplier = config.residual_multiplier
        self.input_multipliers = {mixer: config.input_multipliers.get(mixer, 1.0) for mixer in config.mixers}
        self.output_multipliers = {mixer: config.output_multipliers.get(mixer, 1.0) for mixer in config.mixers}
        self.norm_1 = build_part(config.normalization, name=f"{name}.norm_1", **common)
        self.mixers = nn.ModuleDict(
            {
                mixer: build_part(mixer_config, name=f"{name}.mixers.{mixer}", **common)
                for mixer, mixer_config in config.mixers.items()
            }
        )
        self.mlp = build_part(config.mlp, name=f"{name}.mlp", **common)
        if self.mlp is not None:
            self.norm_2 = build_part(config.normalization, name=f"{name}.norm_2", **common)

    def forward(self, hidden: torch.Tensor, batch: Batch, state: Any = None) -> torch.Tensor:
        normalized = self.norm_1(hidden)
        outputs = {
            name: mixer(scaled(normalized, self.input_multipliers[name]), batch, None if state is None else state[name])
            for name, mixer in self.mixers.items()
        }
        return self._mlp_part(hidden + self._mixers_sum(outputs, hidden), batch)

    def forward_slice(self, hidden: torch.Tensor, batch: Batch, previous: Any) -> tuple[torch.Tensor, Any]:
        """The block over one slice of longer sequences: (output, {mixer: its carry}); see `Mixer.forward_slice`."""
        normalized = self.norm_1(hidden)
        outputs, carries = {}, {}
        for name, mixer in self.mixers.items():
            inputs = scaled(normalized, self.input_multipliers[name])
            outputs[name], carries[name] = mixer.forward_slice(
                inputs, batch, None if previous is None else previous[name]
            )
        carries = tree_map_only(torch.Tensor, not_a_view, carries)  # as the decoder block's (FSDP)
        return self._mlp_part(hidden + self._mixers_sum(outputs, hidden), batch), carries

    def _mixers_sum(self, outputs: dict[str, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        """Each mixer's output times its multiplier, summed in the mixers' order, times the residual multiplier."""
        total = None
        for name, output in outputs.items():
            if output.shape != hidden.shape:  # a plugin's bug, named by the CLI (the sum might broadcast it)
                raise LayerOutputError(self.mixers[name], output.shape, hidden.shape)
            output = scaled(output, self.output_multipliers[name])
            total = output if total is None else total + output
        return scaled(total, self.residual_multiplier)

    def _mlp_part(self, hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
        if self.mlp is None:
            return hidden
        output = self.mlp(self.norm_2(hidden), batch)
        if output.shape != hidden.shape:
            raise LayerOutputError(self.mlp, output.shape, hidden.shape)
        return hidden + scaled(output, self.residual_multiplier)

    def flops(self, batch: Batch) -> tuple[int, int]:
        parts = [mixer.flops(batch) for mixer in self.mixers.values()]
        if self.mlp is not None:
            parts.append(self.mlp.flops(batch))
        return sum(f for f, _ in parts), sum(b for _, b in parts)

    def new_state(self, num_sequences: int, max_length: int, device: torch.device, dtype: torch.dtype) -> Any:
        """Each mixer's generation state, by name."""
        return {name: mixer.new_state(num_sequences, max_length, device, dtype) for name, mixer in self.mixers.items()}
