"""The activation functions of MLPs, by their config name (`blockzoo.layers.config.Activation`)."""

import torch
import torch.nn.functional as F


def _squared_relu(input: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(input))


ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "relu": F.relu,
    "squared_relu": _squared_relu,
    "identity": lambda input: input,
}
