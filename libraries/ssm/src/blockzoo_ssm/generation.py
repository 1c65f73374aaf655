"""The generation state of the Mamba mixers: what each keeps per sequence between decoding steps."""

from __future__ import annotations

import torch

from blockzoo.api import Batch


class SSMState:
    """One layer's state for each sequence, detached and updated in place: `convolution`, the convolution's last
    kernel_size - 1 inputs [sequences, channels, kernel_size - 1] (`CausalConvolution.new_state`), and `ssm`, the
    scan's state [sequences, ...] in fp32 (its shape is the mixer's)."""

    def __init__(self, convolution: torch.Tensor, ssm: torch.Tensor):
        self.convolution = convolution
        self.ssm = ssm

    def check(self, batch: Batch, mixer: str) -> None:
        """ValueError, prefixed by `mixer` (its type and name), unless `batch` continues these sequences."""
        if batch.past_lengths is None:
            raise ValueError(f"{mixer}: a generation state needs `batch.past_lengths`")
        if batch.num_documents != len(self.ssm):
            raise ValueError(
                f"{mixer}: the batch has {batch.num_documents} sequences but the state holds {len(self.ssm)}"
            )
