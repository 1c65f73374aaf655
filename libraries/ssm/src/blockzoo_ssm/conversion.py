"""How the shared causal convolution (`CausalConvolution`) is stored in the references' checkpoints: a depthwise
`nn.Conv1d` named `conv1d` (mamba_ssm, Hugging Face's Mamba models, phi-mamba, fla), its filters
[channels, 1, kernel_size] where ours are [channels, kernel_size]. Torch-free, like every converter section."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from blockzoo.api import ComputedWeights, ConversionError, Weight, WeightMapping
from blockzoo_ssm.config import ConvolutionConfig


def _import_filters(tensors: Sequence[Any]) -> list[Any]:
    (tensor,) = tensors
    if tensor.dim() != 3 or tensor.shape[1] != 1:
        raise ConversionError(f"conv1d.weight of shape {list(tensor.shape)}: expected [channels, 1, kernel_size]")
    return [tensor[:, 0]]


CONVOLUTION_FILTERS = ComputedWeights(
    ("convolution.weight",),
    ("conv1d.weight",),
    import_=_import_filters,
    export=lambda tensors: [tensors[0].unsqueeze(1).contiguous()],
)


def convolution_weights(config: ConvolutionConfig) -> list[WeightMapping]:
    """The convolution's tensors, for a mixer whose field `convolution` it is: the filters, and the bias
    (`conv1d.bias`) when it has one."""
    return [CONVOLUTION_FILTERS, *([Weight("convolution.bias", "conv1d.bias")] if config.has_bias else [])]
