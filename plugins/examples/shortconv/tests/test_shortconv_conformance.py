"""blockzoo's conformance kit on `shortconv.gated_conv`: pytest runs every check of the layer contract that
MixerConformance defines (discovery, config round trip, shapes and dtypes, meta-device construction,
packed documents, every field, gradients, the declared capabilities on gloo ranks, checkpoints, FLOPs).
A failure says what to change. Options (tolerances, tensor-parallel sizes, field exceptions) are class attributes.
"""

from blockzoo.testing import MixerConformance


class TestGatedConvolutionConformance(MixerConformance):
    def config_factory(self):
        # Small (every check builds it several times), with what the defaults leave off switched on so it is checked:
        # projection biases, a kernel longer than the one-token document of the test batch.
        return {"type": "shortconv.gated_conv", "channels": 8, "kernel_size": 3, "add_linear_biases": True}
