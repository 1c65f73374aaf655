"""The dense MLP on one process: against a plain per-token float64 loop for every activation, gated or not, with
and without biases; every config field changes the layer; per-component settings of the fused gate‖up weight;
FLOPs against a hand count; config errors; the plugin's registration."""

import subprocess
import sys

import attrs
import pytest
import torch

from blockzoo.config import ConfigError, structure, update
from blockzoo.layers.base import Batch
from blockzoo.layers.config import (
    GENERATION_CACHE,
    SEQUENCE_DATA_PARALLEL,
    SEQUENCE_TENSOR_PARALLEL,
    TENSOR_PARALLEL,
    MLPConfig,
)
from blockzoo.layers.dims import TensorDim
from blockzoo.plugins import get_registry
from blockzoo_mlp.config import DenseMLPConfig
from blockzoo_mlp.mlp import DenseMLP
from blockzoo_testing import layer_inputs, reference_activation, single_process

HIDDEN, INTERMEDIATE = 8, 12
LENGTHS = [3, 4]
ACTIVATIONS = ["silu", "gelu", "relu", "squared_relu", "identity"]
# Non-zero biases, so that a misplaced bias shows.
RANDOM_BIAS = {"bias": {"initialization": {"type": "normal", "std": 0.5}}}


def make_config(**data) -> DenseMLPConfig:
    return structure({"intermediate_size": INTERMEDIATE, **data}, MLPConfig)


def build(config: DenseMLPConfig, seed: int = 1) -> DenseMLP:
    # gloo: one CPU process (on a CUDA machine `auto` would choose the GPU).
    distributed = single_process(seed)
    return DenseMLP(
        config, name="block.mlp", hidden_dim=TensorDim("hidden", HIDDEN), distributed=distributed, lr_scale=1.0
    )


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return layer_inputs(sum(LENGTHS), HIDDEN)


def reference_mlp(model: DenseMLP, hidden: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The MLP token by token in float64, from the module's weights; returns the output and the float64 leaves."""
    config = model.config
    leaves = {name: parameter.detach().double().requires_grad_() for name, parameter in model.named_parameters()}
    hidden = hidden.double()
    prefix = "gate_up" if config.gated else "up"
    weight, bias = leaves[f"{prefix}.weight"], leaves.get(f"{prefix}.bias")
    outputs = []
    for token in hidden:
        projected = weight @ token + (0 if bias is None else bias)
        if config.gated:  # Gate rows first, then up rows: the documented layout of the fused weight.
            gate, up = projected[:INTERMEDIATE], projected[INTERMEDIATE:]
            # Falcon-H1's MLP: up · act(gate · gate_multiplier), then down · down_multiplier.
            intermediate = reference_activation(config.activation, gate * config.gate_multiplier) * up
        else:
            intermediate = reference_activation(config.activation, projected)
        output = leaves["down.weight"] @ intermediate
        if "down.bias" in leaves:
            output = output + leaves["down.bias"]
        outputs.append(output * config.down_multiplier)
    return torch.stack(outputs), leaves


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("biases", [True, False])
def test_matches_a_per_token_loop(activation, gated, biases):
    model = build(
        make_config(
            gated=gated,
            activation=activation,
            add_linear_biases=biases,
            up=RANDOM_BIAS,
            gate=RANDOM_BIAS if gated else {},
            down=RANDOM_BIAS,
        )
    )
    expected_names = {"gate_up" if gated else "up", "down"}
    assert {name.partition(".")[0] for name, _ in model.named_parameters()} == expected_names
    assert any(name.endswith("bias") for name, _ in model.named_parameters()) == biases
    hidden, output_weights = inputs()
    hidden.requires_grad_()
    output = model(hidden, Batch(LENGTHS))
    (output * output_weights).sum().backward()

    reference_input = hidden.detach().double().requires_grad_()
    reference_output, leaves = reference_mlp(model, reference_input)
    (reference_output * output_weights.double()).sum().backward()
    tolerance = {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(output.double(), reference_output.detach(), **tolerance)
    torch.testing.assert_close(hidden.grad.double(), reference_input.grad, **tolerance)
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad.double(), leaves[name].grad, **tolerance, msg=name)


@pytest.mark.parametrize("gated", [True, False])
def test_the_multipliers_match_the_per_token_loop(gated):
    multipliers = {"gate_multiplier": 2.5} if gated else {}
    model = build(make_config(gated=gated, down_multiplier=0.3, up=RANDOM_BIAS, **multipliers))
    hidden, _ = inputs()
    reference, _ = reference_mlp(model, hidden)
    torch.testing.assert_close(model(hidden, Batch(LENGTHS)).double(), reference.detach(), atol=1e-5, rtol=1e-5)
    plain = build(make_config(gated=gated, up=RANDOM_BIAS))
    assert not torch.allclose(plain(hidden, Batch(LENGTHS)), model(hidden, Batch(LENGTHS)))


def test_gated_default_is_swiglu_and_ungated_default_is_gelu():
    assert make_config(gated=True).activation == "silu"
    assert make_config().activation == "gelu"
    # The default stays derived through updates; an explicit activation stays.
    assert update(make_config(gated=True), {"gated": False}).activation == "gelu"
    assert update(make_config(), {"gated": True}).activation == "silu"
    assert update(make_config(activation="relu"), {"gated": True}).activation == "relu"
    assert DenseMLPConfig(gated=True).explicit_fields() == {"gated"}


def _signature(model: DenseMLP) -> tuple:
    """Everything a field may change: parameter names, shapes, values and settings, and the output."""
    torch.manual_seed(0)
    hidden = torch.randn(sum(LENGTHS), HIDDEN)
    parameters = [
        (name, tuple(parameter.shape), parameter.detach().tolist(), parameter.meta.settings)
        for name, parameter in model.named_parameters()
    ]
    return parameters, model(hidden, Batch(LENGTHS)).detach().tolist()


UNIFORM = {"weight": {"initialization": {"type": "uniform", "low": -1.0, "high": 1.0}}}
# One change per field of DenseMLPConfig, from a gated base.
FIELD_CHANGES = {
    "intermediate_size": {"intermediate_size": 2 * INTERMEDIATE},
    "gated": {"gated": False},
    "activation": {"activation": "relu"},
    "gate": {"gate": UNIFORM},
    "up": {"up": UNIFORM},
    "down": {"down": UNIFORM},
    "add_linear_biases": {"add_linear_biases": True},
    "gate_multiplier": {"gate_multiplier": 3.0},
    "down_multiplier": {"down_multiplier": 0.5},
    "lr_scale": {"lr_scale": 0.5},
}


@pytest.mark.parametrize("field_name", [field.name for field in attrs.fields(DenseMLPConfig)])
def test_every_field_changes_the_layer(field_name):
    assert field_name in FIELD_CHANGES, f"no test changes field {field_name!r}"
    base = make_config(gated=True)
    assert _signature(build(update(base, FIELD_CHANGES[field_name]))) != _signature(build(base))


def test_gate_and_up_keep_their_own_settings_in_the_fused_weight():
    config = make_config(
        gated=True,
        add_linear_biases=True,
        lr_scale=2.0,
        gate={
            "weight": {"initialization": {"type": "fill", "value": 0.25}, "weight_decay": False},
            "lr_scale": 0.5,
            "bias": {"initialization": {"type": "fill", "value": 1.0}},
        },
        up={
            "weight": {"initialization": {"type": "fill", "value": -0.5}},
            "bias": {"initialization": {"type": "fill", "value": 2.0}, "lr_scale": 3.0},
        },
        down={"lr_scale": 0},
    )
    model = build(config)
    gate_rows, up_rows = slice(0, INTERMEDIATE), slice(INTERMEDIATE, None)
    weight, bias = model.gate_up.weight.detach(), model.gate_up.bias.detach()
    assert weight.shape == (2 * INTERMEDIATE, HIDDEN)
    assert (weight[gate_rows] == 0.25).all() and (weight[up_rows] == -0.5).all()
    assert (bias[gate_rows] == 1.0).all() and (bias[up_rows] == 2.0).all()
    lr_scales, decays = model.gate_up.weight.meta.lr_scale_rows(), model.gate_up.weight.meta.weight_decay_rows()
    assert (lr_scales[gate_rows] == 1.0).all() and (lr_scales[up_rows] == 2.0).all()
    assert (decays[gate_rows] == 0.0).all() and (decays[up_rows] == 1.0).all()
    bias_scales = model.gate_up.bias.meta.lr_scale_rows()
    assert (bias_scales[gate_rows] == 1.0).all() and (bias_scales[up_rows] == 6.0).all()
    # The whole MLP's lr_scale multiplies down to its linears; 0 freezes the down projection.
    assert not model.down.weight.requires_grad and not model.down.bias.requires_grad
    # Default initialization: normal with std hidden_size ** -0.5.
    default = build(make_config()).up.weight.detach()
    assert abs(default.std().item() - HIDDEN**-0.5) < 0.05 and abs(default.mean().item()) < 0.05


def test_flops_match_a_hand_count():
    batch = Batch(LENGTHS)
    tokens = sum(LENGTHS)
    matmul = 2 * tokens * HIDDEN * INTERMEDIATE  # One [tokens, hidden] × [hidden, intermediate] product.
    # Forward: gate and up (2 products) + down (1). Backward: input and weight gradients, twice each product.
    assert build(make_config(gated=True)).flops(batch) == (3 * matmul, 6 * matmul)
    assert build(make_config(gated=False)).flops(batch) == (2 * matmul, 4 * matmul)
    # A frozen linear computes no weight gradient: the down projection's backward is one product.
    assert build(make_config(gated=True, down={"lr_scale": 0})).flops(batch) == (3 * matmul, 5 * matmul)


@pytest.mark.parametrize(
    ("data", "path", "message"),
    [
        ({"intermediate_size": 0}, "intermediate_size", "must be >= 1"),
        ({"activation": "tanh"}, "activation", "expected one of 'silu', 'gelu', 'relu', 'squared_relu', 'identity'"),
        ({"gate": {"lr_scale": 0.5}}, "gate", "only a gated MLP has a gate projection"),
        ({"gate_multiplier": 2.0}, "gate_multiplier", "only a gated MLP has a gate projection"),
        (
            {"gated": True, "add_linear_biases": True, "gate": {"bias": {"enabled": False}}},
            "up.bias.enabled",
            "both have a bias or neither (gate bias: False, up bias: True)",
        ),
        ({"lr_scale": -1.0}, "lr_scale", "must be >= 0"),
        ({"gated": "yes"}, "gated", "expected true or false"),
        ({"intermediate": 4}, "intermediate", "did you mean 'intermediate_size'?"),
    ],
)
def test_config_errors_name_the_field(data, path, message):
    with pytest.raises(ConfigError) as error:
        structure({"type": "mlp", **data}, MLPConfig, root="model.decoder.block.mlp")
    assert error.value.errors[0][0] == f"model.decoder.block.mlp.{path}"
    assert message in error.value.errors[0][1]


def test_registered_as_the_default_mlp_type():
    entry = get_registry().resolve("mlp", "mlp")
    assert entry.config_class is DenseMLPConfig and entry.load_implementation() is DenseMLP
    assert entry.plugin.distribution == "blockzoo-mlp"
    assert set(entry.plugin.info.capabilities) == DenseMLPConfig.capabilities
    assert DenseMLPConfig.capabilities == {
        TENSOR_PARALLEL,
        SEQUENCE_TENSOR_PARALLEL,
        SEQUENCE_DATA_PARALLEL,
        GENERATION_CACHE,
    }
    assert type(structure({}, MLPConfig)) is DenseMLPConfig


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_gpu_matches_the_cpu_reference(compute_dtype):
    model = build(make_config(gated=True, add_linear_biases=True, up=RANDOM_BIAS, gate=RANDOM_BIAS))
    hidden, _ = inputs()
    expected, _ = reference_mlp(model, hidden)
    output = model.cuda()(hidden.cuda().to(compute_dtype), Batch(LENGTHS, device="cuda"))
    assert output.dtype == compute_dtype
    tolerance = {"atol": 1e-4, "rtol": 1e-4} if compute_dtype == torch.float32 else {"atol": 5e-2, "rtol": 2e-2}
    torch.testing.assert_close(output.cpu().double(), expected.detach(), **tolerance)


def test_config_and_plugin_modules_import_no_torch():
    script = (
        "import sys; from blockzoo.config import structure; from blockzoo.layers.config import MLPConfig; "
        "structure({'gated': True}, MLPConfig); assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", script], check=True)


def test_tensor_parallel_must_divide_the_intermediate_size():
    from blockzoo.config import ConfigError
    from blockzoo.run_config import RunConfig

    block = {"mixer": {"type": "none"}, "mlp": {"type": "mlp", "intermediate_size": 10}}
    with pytest.raises(ConfigError) as caught:
        structure({"model": {"decoder": {"block": block}}, "distributed": {"tensor_parallel": 4}}, RunConfig)
    assert dict(caught.value.errors) == {
        "model.decoder.block.mlp.intermediate_size": "tensor_parallel=4 must divide it (10)"
    }
