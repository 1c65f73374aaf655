"""`shortconv.gated_conv` against a plain float64 loop over the tokens, written from its definition: the
conformance kit checks that the layer keeps blockzoo's contract, this checks that it computes what it should."""

import pytest
import torch
from blockzoo.api import Batch, ConfigError, Distributed, DistributedConfig, MixerConfig, TensorDim, structure

from blockzoo_shortconv.mixer import GatedConvolution

HIDDEN, LENGTHS = 16, [5, 1, 6]
RANDOM = {"initialization": {"type": "normal", "std": 0.5}}


def build(data: dict) -> GatedConvolution:
    config = structure({"type": "shortconv.gated_conv", **data}, MixerConfig)
    distributed = Distributed(DistributedConfig(backend="gloo"), world_size=1, rank=0, local_rank=0)
    hidden_dim = TensorDim("hidden", HIDDEN)
    return GatedConvolution(config, name="mixer", hidden_dim=hidden_dim, distributed=distributed, lr_scale=1.0)


def reference(layer: GatedConvolution, hidden: torch.Tensor) -> torch.Tensor:
    """For each document, token by token: [x, gate] = in_proj(h); c = bias + Σ_j w[:, K-1-j] · x_(t-j) over the taps
    inside the document; y = out_proj(c · silu(gate))."""
    channels = layer.config.channels
    weight = layer.in_proj.weight.detach().double()
    in_bias = layer.in_proj.bias.detach().double()
    taps = layer.convolution_weight.detach().double()
    conv_bias = layer.convolution_bias.detach().double()
    out_weight, out_bias = layer.out_proj.weight.detach().double(), layer.out_proj.bias.detach().double()
    outputs = []
    for document in hidden.double().split(LENGTHS):
        inputs = []
        for token in document:
            projected = weight @ token + in_bias
            x, gate = projected[:channels], projected[channels:]  # [x of every channel; gate of every channel]
            inputs.append(x)
            convolved = conv_bias.clone()
            for back, earlier in enumerate(reversed(inputs[-taps.shape[1] :])):
                convolved += taps[:, -1 - back] * earlier
            outputs.append(out_weight @ (convolved * gate * torch.sigmoid(gate)) + out_bias)
    return torch.stack(outputs)


@pytest.mark.parametrize("kernel_size", [1, 3, 8])
def test_matches_a_loop_over_the_tokens(kernel_size):
    biases = {"bias": RANDOM}
    layer = build(
        {
            "channels": 8,
            "kernel_size": kernel_size,
            "add_linear_biases": True,
            "input": biases,
            "gate": biases,
            "output": biases,
            "convolution_bias": RANDOM,
        }
    )
    hidden = torch.randn(sum(LENGTHS), HIDDEN, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        output = layer(hidden, Batch(LENGTHS))
    torch.testing.assert_close(output.double(), reference(layer, hidden), atol=1e-5, rtol=1e-5)


def test_defaults():
    layer = build({"channels": 8})
    assert layer.in_proj.bias is None and layer.out_proj.bias is None
    assert layer.convolution_bias is not None and not layer.convolution_bias.any()
    assert layer.convolution_weight.shape == (8, 4) and layer.convolution_weight.abs().max() <= 0.5
    assert build({"channels": 8, "convolution_bias": {"enabled": False}}).convolution_bias is None


def test_input_and_gate_share_one_weight_so_both_or_neither_has_a_bias():
    with pytest.raises(ConfigError, match=r"gate\.bias\.enabled: input and gate are one fused input‖gate weight"):
        structure({"type": "shortconv.gated_conv", "input": {"bias": {"enabled": True}}}, MixerConfig)
