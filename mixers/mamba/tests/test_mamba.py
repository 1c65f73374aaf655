"""The Mamba mixer on one process: against a float64 step-by-step reference, packed documents against separate
runs (outputs and gradients), generation (prefill, then token by token) against the full forward, every config
field, FLOPs, and the generation state's errors."""

import attrs
import pytest
import torch
from mamba_reference import build, reference_forward

from blockzoo.layers.base import Batch
from blockzoo_mamba.config import ConvolutionConfig, MambaConfig
from blockzoo_testing import (
    check_decoding,
    check_generation_refusals,
    check_matches_reference,
    check_packed_documents,
    layer_signature,
    parameter_shapes,
)

LENGTHS = [5, 1, 7]
# Biases and norm weights start at zeros and ones by default: give them values so that they matter.
RANDOM_BIAS = {"bias": {"initialization": {"type": "normal", "std": 0.5}}}
RANDOM_NORM = {"weight": {"initialization": {"type": "normal", "mean": 1.0, "std": 0.3}}}
RANDOM_D = {"initialization": {"type": "normal", "mean": 1.0, "std": 0.5}}
CASES = {
    "standard": {"state_size": 4},
    "standard-biases-norms": {
        "state_size": 4,
        "inner_size": 24,
        "dt_rank": 3,
        "add_linear_biases": True,
        "x": RANDOM_BIAS,
        "z": RANDOM_BIAS,
        "out_proj": RANDOM_BIAS,
        "x_proj": {"bias": {"enabled": True, "initialization": {"type": "normal", "std": 0.5}}},
        "convolution": {"kernel_size": 3, **RANDOM_BIAS},
        "dt_init": "constant",
        "dt_scale": 0.5,
        "d": RANDOM_D,
        "dt_norm": {"type": "rms_norm", **RANDOM_NORM},
        "b_norm": {"type": "layer_norm", **RANDOM_NORM, "bias": {"initialization": {"type": "normal"}}},
        "c_norm": {"type": "rms_norm", "epsilon": 1.0e-3, **RANDOM_NORM},
    },
    "grouped-repeat-before": {
        "state_size": 4,
        "inner_size": 32,
        "xb_size": 16,
        "dt_rank": 2,
        "add_linear_biases": True,
        "z": RANDOM_BIAS,
        "x": RANDOM_BIAS,
        "b": RANDOM_BIAS,
        "c": RANDOM_BIAS,
        "dt_in_proj": RANDOM_BIAS,
        "convolution": RANDOM_BIAS,
        "d": RANDOM_D,
        "dt_norm": {"type": "rms_norm", **RANDOM_NORM},
        "b_norm": {"type": "rms_norm", **RANDOM_NORM},
        "c_norm": {"type": "rms_norm", **RANDOM_NORM},
    },
    "grouped-repeat-after-no-biases": {
        "state_size": 4,
        "inner_size": 24,
        "xb_size": 8,  # 2 x/B heads, each serving 3 of the 6 C heads.
        "repeat_xb_before_convolution": False,
        "dt_bias": {"enabled": False},
        "convolution": {"kernel_size": 2, "bias": {"enabled": False}},
        "d": RANDOM_D,
    },
}


@pytest.mark.parametrize("case", CASES)
def test_matches_a_step_by_step_reference(case):
    layer = build(CASES[case])
    check_matches_reference(layer, reference_forward, lengths=LENGTHS, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_packed_documents_equal_separate_runs(case):
    check_packed_documents(
        build(CASES[case]),
        lengths=LENGTHS,
        tolerance={"atol": 1e-6, "rtol": 1e-5},
        parameter_gradient_tolerance={"atol": 1e-5, "rtol": 1e-5},
    )


def test_parameter_shapes_of_both_layouts():
    standard = build(CASES["standard-biases-norms"])  # hidden 16, inner 24, state 4, dt_rank 3, kernel 3
    assert parameter_shapes(standard) == {
        "dt_bias": (24,),
        "a_log": (24, 4),
        "d": (24,),
        "in_proj.weight": (48, 16),
        "in_proj.bias": (48,),
        "convolution.weight": (24, 3),
        "convolution.bias": (24,),
        "x_proj.weight": (3 + 4 + 4, 24),
        "x_proj.bias": (11,),
        "dt_proj.weight": (24, 3),
        "out_proj.weight": (16, 24),
        "out_proj.bias": (16,),
        "dt_norm.weight": (3,),
        "b_norm.weight": (4,),
        "b_norm.bias": (4,),
        "c_norm.weight": (4,),
    }
    grouped = build(CASES["grouped-repeat-after-no-biases"])  # inner 24, xb 8, dt_rank ceil(16 / 16) = 1
    # parameter_shapes checks that the factory names every parameter by its module path (checkpoints key tensors
    # by it).
    assert parameter_shapes(grouped) == {
        "a_log": (24, 4),
        "d": (24,),
        "in_proj.weight": (24 + 8 + 8 + 24, 16),
        "convolution.weight": (8, 2),
        "dt_in_proj.weight": (1, 16),
        "dt_proj.weight": (24, 1),
        "out_proj.weight": (16, 24),
    }


def test_default_initializations():
    layer = build({"state_size": 4, "dt_rank": 4})
    assert torch.equal(layer.a_log.detach(), torch.log(torch.arange(1.0, 5.0)).expand(32, 4))
    assert torch.equal(layer.d.detach(), torch.ones(32))
    assert torch.equal(layer.convolution.bias.detach(), torch.zeros(32))
    assert layer.convolution.weight.detach().abs().max() <= 4**-0.5
    assert layer.dt_proj.weight.detach().abs().max() <= 4**-0.5
    time_steps = torch.nn.functional.softplus(layer.dt_bias.detach())
    assert time_steps.min() >= 1e-3 - 1e-6 and time_steps.max() <= 0.1 + 1e-6
    assert not any(p.meta.settings[0].weight_decay for p in (layer.a_log, layer.d, layer.dt_bias))
    constant = build({"state_size": 4, "dt_rank": 4, "dt_init": "constant", "dt_scale": 3.0})
    assert torch.equal(constant.dt_proj.weight.detach(), torch.full((32, 4), 3.0 * 4**-0.5))


@pytest.mark.parametrize("case", ["standard-biases-norms", "grouped-repeat-before", "grouped-repeat-after-no-biases"])
def test_generation_equals_the_full_forward(case):
    # Prefill prompts of different lengths, a chunk of several tokens, then one token at a time.
    steps = [[3, 1], [2, 2], [1, 1], [1, 1], [1, 1]]
    check_decoding(build(CASES[case]), tolerance={"atol": 1e-6, "rtol": 1e-5}, lengths=[8, 6], steps=steps)


def test_generation_state_shapes_and_errors():
    grouped = build(CASES["grouped-repeat-after-no-biases"])
    state = grouped.new_state(3, 100, torch.device("cpu"), torch.bfloat16)
    # The convolution runs on the x/B channels before the repetition; the scan state is fp32 whatever the dtype.
    assert state.convolution.shape == (3, 8, 1) and state.convolution.dtype == torch.bfloat16
    assert state.ssm.shape == (3, 24, 4) and state.ssm.dtype == torch.float32
    layer = build({"state_size": 4})
    check_generation_refusals(layer, missing_past=r"a generation state needs `batch\.past_lengths`")


def test_hidden_size_sets_the_default_sizes():
    layer = build({"state_size": 4}, hidden=40)  # inner 2 × 40, dt_rank ceil(40 / 16) = 3
    assert layer.in_proj.weight.shape == (160, 40) and layer.dt_proj.weight.shape == (80, 3)
    assert build({"state_size": 4, "expand": 3}, hidden=8).in_proj.weight.shape == (48, 8)
    check_matches_reference(layer, reference_forward, lengths=[4, 2], atol=2e-6, rtol=1e-5)


def test_a_grouped_layout_the_hidden_size_cannot_split_is_refused():
    # expand 1 × hidden 10 = 10 channels: not heads of 4.
    with pytest.raises(ValueError, match=r"mamba 'mixer': expand: .*heads of state_size \(4\) channels"):
        build({"state_size": 4, "xb_size": 8, "expand": 1}, hidden=10)
    with pytest.raises(ValueError, match=r"mamba 'mixer': expand: its heads \(8\) must divide the heads of inner_size"):
        build({"state_size": 4, "xb_size": 32, "expand": 1})


# ---------------------------------------------------------------------------------------------------------------------
# Every field of the config changes the parameters or the forward pass

STANDARD = {"state_size": 4}
GROUPED = {"state_size": 4, "inner_size": 32, "xb_size": 8}
UNIFORM = {"weight": {"initialization": {"type": "uniform"}}}
FIELD_CHANGES = {
    "state_size": (STANDARD, {"state_size": 8}),
    "inner_size": (STANDARD, {"inner_size": 24}),
    "expand": (STANDARD, {"expand": 3}),
    "xb_size": (STANDARD, {"xb_size": 8}),
    "repeat_xb_before_convolution": (GROUPED, {"repeat_xb_before_convolution": False}),
    "dt_rank": (STANDARD, {"dt_rank": 3}),
    "convolution": (STANDARD, {"convolution": {"kernel_size": 2}}),
    "x": (STANDARD, {"x": UNIFORM}),
    "z": (STANDARD, {"z": {"lr_scale": 0.5}}),
    "b": (GROUPED, {"b": UNIFORM}),
    "c": (GROUPED, {"c": UNIFORM}),
    "x_proj": (STANDARD, {"x_proj": {"bias": {"enabled": True}}}),
    "dt_in_proj": (GROUPED, {"dt_in_proj": {"bias": {"enabled": True}}}),
    "dt_proj": (STANDARD, {"dt_proj": {"weight": {"initialization": {"type": "normal"}}}}),
    "dt_init": (STANDARD, {"dt_init": "constant"}),
    "dt_scale": (STANDARD, {"dt_scale": 0.5}),
    "dt_bias": (STANDARD, {"dt_bias": {"enabled": False}}),
    "a_log": (STANDARD, {"a_log": {"initialization": {"type": "fill", "value": 0.5}}}),
    "d": (STANDARD, {"d": {"initialization": {"type": "fill", "value": 2.0}}}),
    "out_proj": (STANDARD, {"out_proj": {"bias": {"enabled": True}}}),
    "add_linear_biases": (STANDARD, {"add_linear_biases": True}),
    "dt_norm": (STANDARD, {"dt_norm": {"type": "rms_norm"}}),
    "b_norm": (GROUPED, {"b_norm": {"type": "rms_norm"}}),
    "c_norm": (STANDARD, {"c_norm": {"type": "rms_norm"}}),
    "lr_scale": (STANDARD, {"lr_scale": 0.0}),
}
CONVOLUTION_CHANGES = {
    "kernel_size": {"kernel_size": 3},
    "weight": UNIFORM,
    "bias": {"bias": {"enabled": False}},
    "lr_scale": {"lr_scale": 0.5},
}


def _changes_something(base_config: dict, change: dict) -> bool:
    layer = build({**base_config, **change})
    assert layer.config.explicit_fields() >= set(change)
    return layer_signature(layer, LENGTHS).differs_from(layer_signature(build(base_config), LENGTHS))


def test_every_field_changes_parameters_or_outputs():
    assert {field.name for field in attrs.fields(MambaConfig)} == set(FIELD_CHANGES), "a field without a test case"
    for name, (base_config, change) in FIELD_CHANGES.items():
        assert _changes_something(base_config, change), f"changing {name} changed nothing"
    assert {field.name for field in attrs.fields(ConvolutionConfig)} == set(CONVOLUTION_CHANGES)
    for name, change in CONVOLUTION_CHANGES.items():
        assert _changes_something(STANDARD, {"convolution": change}), f"changing convolution.{name} changed nothing"


def test_in_proj_component_configs_are_honoured_for_their_rows():
    # Grouped rows: z 0-31, x 32-39, b 40-47, c 48-79.
    layer = build({**GROUPED, "b": {"lr_scale": 0.5, "weight": {"initialization": {"type": "fill", "value": 0.25}}}})
    rows = layer.in_proj.weight.meta.lr_scale_rows().flatten()
    assert rows[40:48].eq(0.5).all() and rows[:40].eq(1.0).all() and rows[48:].eq(1.0).all()
    weight = layer.in_proj.weight.detach()
    assert weight[40:48].eq(0.25).all() and not weight[:40].eq(0.25).any() and not weight[48:].eq(0.25).any()


# ---------------------------------------------------------------------------------------------------------------------
# FLOPs


def test_flops_against_a_hand_count():
    # hidden 16, inner 32, state 4, dt_rank 1, kernel 4, 7 tokens. in_proj 16→64, x_proj 32→9, dt_proj 1→32,
    # out_proj 32→16; the convolution 4 multiply-adds per channel; the scan 8 per channel and state entry.
    tokens = 7
    linears = 2 * tokens * (16 * 64 + 32 * 9 + 1 * 32 + 32 * 16)
    convolution = 2 * 4 * 32 * tokens
    scan = 8 * 32 * 4 * tokens
    assert build(STANDARD).flops(Batch([5, 2])) == (
        linears + convolution + scan,
        2 * linears + 2 * (convolution + scan),
    )
    # Grouped, repeated after the convolution (on 8 channels): in_proj 16→(32+8+8+32), dt_in_proj 16→1.
    grouped = build({**GROUPED, "repeat_xb_before_convolution": False})
    linears = 2 * tokens * (16 * 80 + 16 * 1 + 1 * 32 + 32 * 16)
    convolution = 2 * 4 * 8 * tokens
    assert grouped.flops(Batch([5, 2])) == (linears + convolution + scan, 2 * linears + 2 * (convolution + scan))
    # A frozen projection needs no weight gradient: its backward costs one forward.
    frozen = build({**GROUPED, "repeat_xb_before_convolution": False, "out_proj": {"lr_scale": 0.0}})
    assert frozen.flops(Batch([5, 2]))[1] == 2 * linears - 2 * tokens * 32 * 16 + 2 * (convolution + scan)
