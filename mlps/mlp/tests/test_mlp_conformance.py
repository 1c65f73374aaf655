"""blockzoo's conformance kit (`blockzoo_testing`) on the dense MLP: discovery, config, shapes, packed documents,
every field, gradients, tensor and sequence-tensor parallel, generation, checkpoints, FLOPs; and its Llama converter
section (config and weights both ways, everything claimed)."""

from blockzoo_testing import ConverterSectionConformance, MLPConformance


class TestDenseMLPConformance(MLPConformance):
    def config_factory(self):
        return {"type": "mlp", "intermediate_size": 24, "gated": True, "add_linear_biases": True}


class TestDenseMLPLlamaSectionConformance(ConverterSectionConformance):
    kind, format_name = "mlp", "llama"

    def config_factory(self):
        return {"type": "mlp", "intermediate_size": 24, "gated": True, "add_linear_biases": True, "activation": "gelu"}
