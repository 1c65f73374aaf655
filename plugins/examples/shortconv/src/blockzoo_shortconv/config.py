"""Config of the `shortconv.gated_conv` mixer. Torch-free: blockzoo imports it to list plugins and validate configs
without loading torch.

Every field has a default and a doc (`blockzoo config schema` prints them), and every field changes the layer's
parameters or outputs (the conformance kit checks it).
"""

from __future__ import annotations

from typing import ClassVar

from blockzoo.api import (
    GENERATION_CACHE,
    SEQUENCE_DATA_PARALLEL,
    SEQUENCE_TENSOR_PARALLEL,
    TENSOR_PARALLEL,
    BiasConfig,
    LinearConfig,
    MixerConfig,
    ParameterConfig,
    at_least,
    check,
    check_fused_biases,
    configclass,
    field,
)


@configclass
class GatedConvolutionConfig(MixerConfig):
    """y = output(conv(x) · silu(gate)) with [x, gate] = input projection of the hidden state, and conv a depthwise
    causal convolution over each document: channel c of token t sees channel c of tokens t - kernel_size + 1 .. t of
    its own document (the gated short convolution of H3, Hyena and Mamba's conv1d)."""

    # What the layer can do: blockzoo refuses a run that needs more, and the conformance kit checks each claim.
    capabilities: ClassVar[frozenset[str]] = frozenset(
        {TENSOR_PARALLEL, SEQUENCE_TENSOR_PARALLEL, SEQUENCE_DATA_PARALLEL, GENERATION_CACHE}
    )

    channels: int = field(256, doc="Width of the convolved values x and of the gate.", validator=at_least(1))
    kernel_size: int = field(4, doc="Tokens each convolution sees, the current one included.", validator=at_least(1))
    input: LinearConfig = field(
        factory=LinearConfig, doc="The projection hidden -> x (the convolved part of the fused input projection)."
    )
    gate: LinearConfig = field(
        factory=LinearConfig, doc="The projection hidden -> gate (the gating part of the fused input projection)."
    )
    output: LinearConfig = field(factory=LinearConfig, doc="The output projection, channels -> hidden.")
    convolution: ParameterConfig = field(
        factory=ParameterConfig,
        doc="The convolution weight [channels, kernel_size]; default uniform in ±kernel_size**-0.5 (torch's Conv1d).",
    )
    convolution_bias: BiasConfig = field(
        factory=BiasConfig,
        doc="The convolution's per-channel bias (zeros, no weight decay); enabled unless `enabled: false`.",
    )
    add_linear_biases: bool = field(False, doc="Default of each projection's `bias.enabled`.")
    lr_scale: float | None = field(
        None, doc="Multiplies the parent's learning-rate scale; 0 freezes.", validator=at_least(0)
    )

    def __attrs_post_init__(self) -> None:
        # One weight holds both projections' rows, so one bias or none: refused at gate.bias.enabled otherwise.
        check_fused_biases({"input": self.input, "gate": self.gate}, self.add_linear_biases, weight="input‖gate")

    def check_tensor_parallel(self, tensor_parallel: int) -> None:
        # Called before a run starts: refuse a split the layer cannot do, naming the field.
        check(
            self.channels % tensor_parallel == 0,
            "channels",
            f"tensor_parallel={tensor_parallel} must divide it ({self.channels})",
        )
