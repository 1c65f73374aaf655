"""The Mamba 2 mixer on one process: against a float64 per-token loop, packed documents against separate runs,
generation state against the full forward, every config field, per-component in_proj settings, FLOPs."""

import attrs
import pytest
import torch
from mamba_2_reference import AROUND_ONE, RANDOM, SEED, build, reference_forward

import blockzoo_mamba_2.mamba_2 as mamba_2_module
from blockzoo.layers.base import Batch
from blockzoo_mamba_2.config import ConvolutionConfig, GatedNormalizationConfig, Mamba2Config
from blockzoo_testing import (
    LayerSignature,
    check_bf16_compute,
    check_decoding,
    check_generation_refusals,
    check_matches_reference,
    check_packed_documents,
    layer_inputs,
    layer_signature,
    parameter_shapes,
    parameters_without_weight_decay,
    single_process,
)

LENGTHS = [5, 1, 7]  # Not multiples of the chunk size (4), and a document of one token.
SMALL = {"heads": 4, "head_size": 4, "state_size": 3, "chunk_size": 4}
# Time steps around 0.1-3 (softplus of N(0, 1)): the state decays visibly within a document.
LARGE_DT = {"dt_bias": {"initialization": {"type": "normal", "std": 1.0}}}
CASES = {
    "groups-per-group-norm": {
        **SMALL,
        **LARGE_DT,
        "groups": 2,
        "convolution": {"kernel_size": 3, "bias": RANDOM},
        "normalization": {"weight": AROUND_ONE},
    },
    "whole-inner-norm-d-per-channel": {
        **SMALL,
        **LARGE_DT,
        "groups": 2,
        "d_per_channel": True,
        "d": AROUND_ONE,
        "normalization": {"per_group": False, "epsilon": 0.1},
    },
    "biases-dt-limit-no-conv-bias": {
        **SMALL,
        **LARGE_DT,
        "add_linear_biases": True,
        "z": {"bias": RANDOM},
        "x": {"bias": RANDOM},
        "dt": {"bias": RANDOM},
        "out_proj": {"bias": RANDOM},
        "dt_limit": [0.2, 0.8],
        "convolution": {"kernel_size": 2, "bias": {"enabled": False}},
        "d": RANDOM,
    },
    "one-group-one-chunk-default-dt": {**SMALL, "chunk_size": 256, "groups": 1, "d": AROUND_ONE},
    "a-group-per-head-kernel-size-one": {**SMALL, **LARGE_DT, "groups": 4, "convolution": {"kernel_size": 1}},
    # The output norm's variants (Falcon-H1): normalize y, then gate; no norm at all.
    "norm-before-gate": {
        **SMALL,
        **LARGE_DT,
        "groups": 2,
        "normalization": {"norm_before_gate": True, "weight": AROUND_ONE, "epsilon": 0.1},
    },
    "no-norm": {**SMALL, **LARGE_DT, "groups": 2, "normalization": {"enabled": False}},
}


@pytest.mark.parametrize("case", CASES)
def test_matches_a_per_token_loop(case):
    layer = build(CASES[case])
    check_matches_reference(layer, reference_forward, lengths=LENGTHS, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("case", CASES)
def test_packed_documents_equal_separate_runs(case):
    layer = build(CASES[case])
    assert {name for name, parameter in layer.named_parameters() if parameter.requires_grad} == {
        "in_proj.weight",
        *(["in_proj.bias", "out_proj.bias"] if layer.config.add_linear_biases else []),
        "convolution.weight",
        *(["convolution.bias"] if layer.config.convolution.has_bias else []),
        "dt_bias",
        "a_log",
        "d",
        *(["normalization.weight"] if layer.config.normalization.enabled else []),  # no norm, no weight
        "out_proj.weight",
    }
    check_packed_documents(
        layer,
        lengths=LENGTHS,
        tolerance={"atol": 1e-5, "rtol": 1e-5},
        parameter_gradient_tolerance={"atol": 1e-5, "rtol": 1e-4},
    )


def test_parameter_names_and_shapes():
    layer = build({**SMALL, "groups": 2, "d_per_channel": True})
    # in_proj rows: z (16) ‖ x (16) ‖ B (2 groups · 3) ‖ C (6) ‖ dt (4 heads); the convolution covers x‖B‖C.
    assert parameter_shapes(layer) == {
        "in_proj.weight": (48, 16),
        "convolution.weight": (28, 4),
        "convolution.bias": (28,),
        "dt_bias": (4,),
        "a_log": (4,),
        "d": (16,),
        "normalization.weight": (16,),
        "out_proj.weight": (16, 16),
    }


def test_default_initializations():
    layer = build({"heads": 64, "head_size": 2, "state_size": 2, "convolution": {"kernel_size": 4}})
    a = torch.exp(layer.a_log.detach())
    assert bool(((a >= 1) & (a <= 16)).all()) and float(a.std()) > 2  # uniform [1, 16]
    dt = torch.nn.functional.softplus(layer.dt_bias.detach())
    assert bool(((dt >= 1e-3 * 0.999) & (dt <= 0.1 * 1.001)).all())  # log-uniform time steps in [1e-3, 0.1]
    assert bool(layer.d.detach().eq(1).all()) and bool(layer.normalization.weight.detach().eq(1).all())
    assert bool(layer.convolution.bias.detach().eq(0).all())
    filters = layer.convolution.weight.detach()
    assert float(filters.abs().max()) <= 0.5 and float(filters.abs().max()) > 0.4  # uniform(±4^-0.5)
    assert parameters_without_weight_decay(layer) == {
        "convolution.bias",
        "dt_bias",
        "a_log",
        "d",
        "normalization.weight",
    }


@pytest.mark.parametrize(
    "case",
    [
        "groups-per-group-norm",
        "biases-dt-limit-no-conv-bias",
        "a-group-per-head-kernel-size-one",
        "norm-before-gate",
        "no-norm",
    ],
)
def test_generation_state_equals_the_full_forward(case):
    layer = build(CASES[case])
    state = layer.new_state(2, 10, torch.device("cpu"), torch.float32)
    assert state.ssm.dtype == torch.float32 and state.ssm.shape == (2, 4, 4, 3)
    # Prefill prompts of different lengths, a chunk of several tokens, then one token at a time.
    steps = [[3, 2], [2, 1], [1, 1], [1, 1], [1, 1]]
    check_decoding(layer, tolerance={"atol": 1e-5, "rtol": 1e-5}, lengths=[8, 6], steps=steps)


def test_bf16_compute_is_close_to_fp32():
    """Activations in bf16 (master weights fp32): the output keeps the dtype, gradients reach fp32 weights."""
    layer = build(CASES["groups-per-group-norm"], single_process(SEED, compute_dtype="bf16"))
    check_bf16_compute(layer, build(CASES["groups-per-group-norm"]), lengths=LENGTHS)


def test_generation_state_errors():
    layer = build(SMALL)
    check_generation_refusals(layer)


# ---------------------------------------------------------------------------------------------------------------------
# Every field of the config changes the parameters or the forward pass

FIELD_CHANGES = {
    "heads": {"heads": 8},
    "head_size": {"head_size": 2},
    "groups": {"groups": 1},
    "state_size": {"state_size": 2},
    "convolution": {"convolution": {"kernel_size": 2}},
    "z": {"z": {"weight": {"initialization": {"type": "uniform"}}}},
    "x": {"x": {"weight": {"initialization": {"type": "uniform"}}}},
    "b": {"b": {"lr_scale": 0.5}},
    "c": {"c": {"weight": {"initialization": {"type": "uniform"}}}},
    "dt": {"dt": {"weight": {"initialization": {"type": "uniform"}}}},
    "out_proj": {"out_proj": {"bias": {"enabled": True}}},
    "add_linear_biases": {"add_linear_biases": True},
    "dt_bias": {"dt_bias": {"initialization": {"type": "fill", "value": 1.0}}},
    "dt_limit": {"dt_limit": [0.2, 0.3]},
    "a_log": {"a_log": {"initialization": {"type": "fill", "value": 0.5}}},
    "d": {"d": {"weight_decay": True}},
    "d_per_channel": {"d_per_channel": True},
    "normalization": {"normalization": {"per_group": False}},
    "in_proj_multipliers": {"in_proj_multipliers": {"c": 0.5}},
    "lr_scale": {"lr_scale": 0.0},
}
# The fields of the nested configs, each changed on its own.
NESTED_CHANGES = {
    ("convolution", "kernel_size"): {"kernel_size": 2},
    ("convolution", "weight"): {"weight": {"initialization": {"type": "normal"}}},
    ("convolution", "bias"): {"bias": {"enabled": False}},
    ("convolution", "lr_scale"): {"lr_scale": 0.5},
    ("normalization", "enabled"): {"enabled": False},
    ("normalization", "norm_before_gate"): {"norm_before_gate": True},
    ("normalization", "epsilon"): {"epsilon": 10.0},
    ("normalization", "per_group"): {"per_group": False},
    ("normalization", "weight"): {"weight": {"lr_scale": 0.5}},
    ("normalization", "lr_scale"): {"lr_scale": 0.0},
}
_NESTED = [("convolution", ConvolutionConfig), ("normalization", GatedNormalizationConfig)]
FIELD_BASE = {**SMALL, "groups": 2}


def _changes_something(change: dict, base: LayerSignature) -> bool:
    layer = build({**FIELD_BASE, **change})
    assert layer.config.explicit_fields() >= set(change)
    return layer_signature(layer, LENGTHS).differs_from(base)


def test_every_field_changes_parameters_or_outputs():
    exempt = {"chunk_size", "recompute_convolution"}  # each tested below: neither changes the result
    assert {field.name for field in attrs.fields(Mamba2Config)} == {*FIELD_CHANGES, *exempt}, "a field untested"
    nested = {(owner, field.name) for owner, cls in _NESTED for field in attrs.fields(cls)}
    assert nested == set(NESTED_CHANGES), "a nested field untested"
    base = layer_signature(build(FIELD_BASE), LENGTHS)
    for name, change in FIELD_CHANGES.items():
        assert _changes_something(change, base), f"changing {name} changed nothing"
    for (owner, name), change in NESTED_CHANGES.items():
        assert _changes_something({owner: change}, base), f"changing {owner}.{name} did nothing"


def test_in_proj_multipliers_scale_the_rows_of_each_component():
    """Scaling a component's output (Falcon-H1's mup vector) is scaling its rows of in_proj, bias included."""
    multipliers = {"z": 0.5, "x": 2.0, "b": 1.5, "c": 0.25, "dt": 3.0}
    config = {**FIELD_BASE, "add_linear_biases": True, "in_proj_multipliers": multipliers}
    scaled, plain = build(config), build({**config, "in_proj_multipliers": {}})
    inner, state, heads = 4 * 4, 2 * 3, 4  # heads · head_size; groups · state_size; heads
    rows = {"z": inner, "x": inner, "b": state, "c": state, "dt": heads}
    vector = torch.cat([torch.full((rows[role],), multipliers[role]) for role in ("z", "x", "b", "c", "dt")])
    with torch.no_grad():
        plain.load_state_dict(scaled.state_dict())
        plain.in_proj.weight.mul_(vector[:, None])
        plain.in_proj.bias.mul_(vector)
    hidden, _ = layer_inputs(sum(LENGTHS))
    with torch.no_grad():
        torch.testing.assert_close(scaled(hidden, Batch(LENGTHS)), plain(hidden, Batch(LENGTHS)), rtol=1e-5, atol=1e-6)


def test_chunk_size_reaches_the_scan_and_changes_only_rounding(monkeypatch):
    """The chunk size splits the scan's work, not its result: the scan is called with it, and the outputs agree."""
    hidden, _ = layer_inputs(sum(LENGTHS))
    outputs, seen = [], []
    scan = mamba_2_module.ssd_scan

    def recording_scan(*args, **kwargs):
        seen.append(kwargs["chunk_size"])
        return scan(*args, **kwargs)

    monkeypatch.setattr(mamba_2_module, "ssd_scan", recording_scan)
    for chunk_size in (2, 3, 256):
        with torch.no_grad():
            # the plain path (the convolved scan passes chunk_size on to ssd_scan from its own module)
            config = {**CASES["groups-per-group-norm"], "chunk_size": chunk_size, "recompute_convolution": False}
            outputs.append(build(config)(hidden, Batch(LENGTHS)))
    assert seen == [2, 3, 256]
    for output in outputs[1:]:
        torch.testing.assert_close(output, outputs[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_recompute_convolution_takes_the_convolved_scan_and_changes_nothing(case, monkeypatch):
    """With the option the mixer's convolution and scan go through `convolved_ssd_scan` (here its two-step path:
    on the GPU the memory differs, core/tests/test_conv_scan.py); outputs and gradients are the plain mixer's."""
    calls = []
    convolved = mamba_2_module.convolved_ssd_scan

    def recording(*args, **kwargs):
        calls.append(kwargs["chunk_size"])
        return convolved(*args, **kwargs)

    monkeypatch.setattr(mamba_2_module, "convolved_ssd_scan", recording)
    results = []
    for recompute in (False, True):
        layer = build({**CASES[case], "recompute_convolution": recompute})
        hidden, weights = layer_inputs(sum(LENGTHS))
        hidden.requires_grad_()
        (layer(hidden, Batch(LENGTHS)) * weights).sum().backward()
        results.append([hidden.grad, *(parameter.grad for parameter in layer.parameters())])
    assert calls == [CASES[case]["chunk_size"]]
    for found, expected in zip(*reversed(results), strict=True):
        torch.testing.assert_close(found, expected, rtol=1e-6, atol=1e-7)


def test_in_proj_components_are_honoured_for_their_rows():
    layer = build({**SMALL, "dt": {"lr_scale": 0.5, "weight": {"initialization": {"type": "fill", "value": 0.25}}}})
    # Rows: z 16, x 16, B 3, C 3, dt 4.
    rows = layer.in_proj.weight.meta.lr_scale_rows().flatten()
    assert rows[:38].eq(1.0).all() and rows[38:].eq(0.5).all()
    weight = layer.in_proj.weight.detach()
    assert weight[38:].eq(0.25).all() and not weight[:38].eq(0.25).any()


def test_hidden_size_differs_from_the_inner_size():
    layer = build({"heads": 3, "head_size": 5, "state_size": 2, "chunk_size": 4}, hidden=10)
    output = check_matches_reference(layer, reference_forward, lengths=[4, 2], atol=2e-5, rtol=1e-4)
    assert output.shape == (6, 10) and layer.out_proj.weight.shape == (10, 15)


# ---------------------------------------------------------------------------------------------------------------------
# FLOPs


def test_flops_against_a_hand_count():
    # hidden 16, heads 4 × head_size 4 = inner 16, groups 2, state 3, kernel 3.
    layer = build({**SMALL, "groups": 2, "convolution": {"kernel_size": 3}})
    tokens = 7
    in_proj = 2 * tokens * 16 * (16 + 16 + 6 + 6 + 4)
    out_proj = 2 * tokens * 16 * 16
    convolution = 2 * tokens * 3 * (16 + 6 + 6)
    scan = 6 * tokens * 16 * 3
    forward = in_proj + out_proj + convolution + scan
    assert layer.flops(Batch([5, 2])) == (forward, 2 * forward)
    # A frozen in_proj needs no weight gradient: its backward costs one forward.
    frozen = build({**SMALL, "groups": 2, "convolution": {"kernel_size": 3}, "lr_scale": 0.0})
    assert frozen.flops(Batch([5, 2]))[1] == in_proj + out_proj + 2 * (convolution + scan)
