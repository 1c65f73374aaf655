"""The discrete Mamba 2 mixer on one process: against a float64 step-by-step loop and transformers' Mamba 2 chunk
scan, packed documents against separate runs, decoding against the full forward, every config field, FLOPs,
initializations, and a hybrid model that generates."""

import inspect

import attrs
import pytest
import torch
from dm2_reference import RANDOM, RANDOM_BIAS, SMALL, build, reference_forward

import blockzoo
import blockzoo_discrete_mamba_2.mixer as mixer_module
from blockzoo.layers.base import Batch
from blockzoo_discrete_mamba_2.config import DiscreteMamba2Config
from blockzoo_testing import (
    check_decoding,
    check_generation_refusals,
    check_matches_reference,
    check_packed_documents,
    layer_inputs,
    layer_signature,
    parameter_shapes,
)

LENGTHS = [7, 1, 10]  # Not multiples of the chunk size (4); one document shorter than the convolution.
CASES = {
    "grouped-identity": {**SMALL},
    "one-group-silu-kernel-2": {**SMALL, "groups": 1, "activation": "silu", "convolution": {"kernel_size": 2}},
    "biases-no-z-bias": {
        **SMALL,
        "add_linear_biases": True,
        **{name: RANDOM_BIAS for name in ("x", "b", "c", "z", "dt", "out_proj")},
        "d": RANDOM,
    },
    "z-bias-no-conv-bias-mha": {
        **SMALL,
        "groups": 4,
        "chunk_size": 3,
        "convolution": {"kernel_size": 3, "bias": {"enabled": False}},
        "z_bias": RANDOM,
        "d": RANDOM,
    },
}


@pytest.mark.parametrize("case", CASES)
def test_matches_a_step_by_step_loop(case):
    layer = build(CASES[case])
    check_matches_reference(layer, reference_forward, lengths=LENGTHS, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["grouped-identity", "z-bias-no-conv-bias-mha"])
def test_matches_transformers_mamba2_chunk_scan(case):
    # The recipe of the reference notes: HF's torch SSD with x / dt, dt = softplus(a_log), A = -1. Unwrapped, so that
    # it is the torch path even where mamba_ssm imports (transformers would then dispatch to its Triton kernel).
    modeling_mamba2 = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
    torch_chunk_scan = inspect.unwrap(modeling_mamba2.mamba2_chunk_scan)
    assert torch_chunk_scan.__module__ == modeling_mamba2.__name__
    layer = build(CASES[case])
    chunk_size = layer.config.chunk_size

    def transformers_scan(x, a_log, b, c):
        dt = torch.nn.functional.softplus(a_log)
        heads = x.shape[1]
        return torch_chunk_scan(
            (x / dt[..., None])[None],
            a_log[None],
            -torch.ones(heads, dtype=x.dtype),
            b[None],
            c[None],
            chunk_size,
            dt_softplus=True,
        )[0]

    hidden, _ = layer_inputs(sum(LENGTHS))
    with torch.no_grad():
        output = layer(hidden, Batch(LENGTHS))
        expected = reference_forward(layer, hidden, LENGTHS, scan=transformers_scan)
    torch.testing.assert_close(output.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_packed_documents_equal_separate_runs(case):
    layer = build(CASES[case])
    assert all(parameter.requires_grad for parameter in layer.parameters())
    check_packed_documents(layer, lengths=LENGTHS, tolerance={"atol": 1e-5, "rtol": 1e-5})


@pytest.mark.parametrize("case", ["grouped-identity", "one-group-silu-kernel-2", "z-bias-no-conv-bias-mha"])
def test_decoding_equals_the_full_forward(case):
    layer = build(CASES[case])
    assert layer.new_state(2, 10, torch.device("cpu"), torch.float32).ssm.dtype == torch.float32
    # Prefill prompts of different lengths (one shorter than the convolution), a chunk, then one token at a time.
    steps = [[5, 1], [2, 3], [1, 1], [1, 1]]
    check_decoding(layer, tolerance={"atol": 1e-5, "rtol": 1e-5}, lengths=[9, 6], steps=steps)


def test_generation_state_errors():
    layer = build(SMALL)
    check_generation_refusals(layer)


def test_new_state_shapes():
    layer = build({**SMALL, "convolution": {"kernel_size": 3}})
    state = layer.new_state(3, 100, torch.device("cpu"), torch.bfloat16)
    # Convolution channels: x (4 heads · 3) + B and C (2 groups · 5 each).
    assert state.conv.shape == (3, 12 + 10 + 10, 2) and state.conv.dtype == torch.bfloat16
    assert state.ssm.shape == (3, 4, 3, 5) and state.ssm.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------------------------
# Parameters


def test_parameters_and_default_initializations():
    layer = build({**SMALL, "convolution": {"kernel_size": 4}})
    # in_proj rows: x 12, B 10, C 10, z 12, dt 4.
    assert parameter_shapes(layer) == {
        "in_proj.weight": (48, 16),
        "convolution.weight": (32, 4),
        "convolution.bias": (32,),
        "z_bias": (12,),
        "d": (4,),
        "out_proj.weight": (16, 12),
    }
    assert layer.d.detach().eq(1).all() and layer.z_bias.detach().eq(0).all()
    for parameter in (layer.convolution.weight, layer.convolution.bias):
        assert parameter.detach().abs().max() <= 0.5 and parameter.detach().std() > 0.1  # uniform(±4**-0.5)
    assert abs(float(layer.in_proj.weight.detach().std()) - 16**-0.5) < 0.05
    weight_decay = {name: parameter.meta.settings[0].weight_decay for name, parameter in layer.named_parameters()}
    assert weight_decay == {
        "in_proj.weight": True,
        "convolution.weight": True,
        "convolution.bias": False,
        "z_bias": False,
        "d": False,
        "out_proj.weight": True,
    }


def test_in_proj_bias_replaces_z_bias():
    layer = build({**SMALL, "add_linear_biases": True})
    assert layer.z_bias is None and layer.in_proj.bias.shape == (48,) and layer.out_proj.bias.shape == (16,)
    layer = build({**SMALL, "add_linear_biases": True, "out_proj": {"bias": {"enabled": False}}})
    assert layer.z_bias is None and layer.out_proj.bias is None


def test_each_in_proj_component_config_is_honoured_for_its_rows():
    layer = build(
        {
            **SMALL,
            "b": {"lr_scale": 0.5},
            "dt": {"weight": {"initialization": {"type": "fill", "value": 0.25}}},
        }
    )
    rows = layer.in_proj.weight.meta.lr_scale_rows().flatten()
    assert rows[:12].eq(1).all() and rows[12:22].eq(0.5).all() and rows[22:].eq(1).all()
    weight = layer.in_proj.weight.detach()
    assert weight[44:].eq(0.25).all() and not weight[:44].eq(0.25).any()


# ---------------------------------------------------------------------------------------------------------------------
# Every field of the config changes the parameters or the forward pass

FIELD_CHANGES = {
    "heads": {"heads": 8},
    "groups": {"groups": 1},
    "head_size": {"head_size": 2},
    "state_size": {"state_size": 3},
    "convolution": {"convolution": {"kernel_size": 2}},
    "activation": {"activation": "silu"},
    "x": {"x": {"weight": {"initialization": {"type": "uniform"}}}},
    "b": {"b": {"lr_scale": 0.5}},
    "c": {"c": {"weight": {"initialization": {"type": "uniform"}}}},
    "z": {"z": {"weight": {"initialization": {"type": "uniform"}}}},
    "dt": {"dt": {"weight": {"initialization": {"type": "uniform"}}}},
    "out_proj": {"out_proj": {"bias": {"enabled": True}}},
    "add_linear_biases": {"add_linear_biases": True},
    "z_bias": {"z_bias": {"initialization": {"type": "normal"}}},
    "d": {"d": {"weight_decay": True}},
    "lr_scale": {"lr_scale": 0.0},
}
CONVOLUTION_FIELD_CHANGES = {
    "kernel_size": {"kernel_size": 3},
    "weight": {"weight": {"initialization": {"type": "normal"}}},
    "bias": {"bias": {"enabled": False}},
    "lr_scale": {"lr_scale": 0.5},
}


def _changes_something(base_config: dict, change: dict) -> bool:
    signature = layer_signature(build({**base_config, **change}), LENGTHS)
    return signature.differs_from(layer_signature(build(base_config), LENGTHS))


def test_every_field_changes_parameters_or_outputs():
    declared = {field.name for field in attrs.fields(DiscreteMamba2Config)}
    assert declared == {*FIELD_CHANGES, "chunk_size"}, "a field without a test case"
    for name, change in FIELD_CHANGES.items():
        assert _changes_something(SMALL, change), f"changing {name} changed nothing"
    convolution_fields = {field.name for field in attrs.fields(type(DiscreteMamba2Config().convolution))}
    assert convolution_fields == set(CONVOLUTION_FIELD_CHANGES)
    for name, change in CONVOLUTION_FIELD_CHANGES.items():
        assert _changes_something(SMALL, {"convolution": change}), f"changing convolution.{name} changed nothing"


def test_chunk_size_reaches_the_scan(monkeypatch):
    # The chunk size changes how the scan is computed, not its result (up to rounding): check that it is used.
    seen = []
    scan = mixer_module.ssd_scan

    def recording_scan(*args, chunk_size, **kwargs):
        seen.append(chunk_size)
        return scan(*args, chunk_size=chunk_size, **kwargs)

    monkeypatch.setattr(mixer_module, "ssd_scan", recording_scan)
    hidden, _ = layer_inputs(sum(LENGTHS))
    with torch.no_grad():
        build({**SMALL, "chunk_size": 5})(hidden, Batch(LENGTHS))
    assert seen == [5]


# ---------------------------------------------------------------------------------------------------------------------
# FLOPs


def test_flops_against_a_hand_count():
    # hidden 16, heads 4 × 3 (inner 12), 2 groups × state 5, kernel 4.
    # in_proj 16 → 12 + 10 + 10 + 12 + 4 = 48, out_proj 12 → 16: 16·48 + 12·16 = 960 multiply-adds per token.
    # Convolution: 32 channels × 4 taps = 128 multiply-adds per token. Scan: 4 · heads · head_size · state = 240.
    tokens = 7
    linears, convolution, scan = 2 * tokens * 960, 2 * tokens * 128, tokens * 240
    layer = build({**SMALL, "convolution": {"kernel_size": 4}})
    assert layer.flops(Batch([5, 2])) == (linears + convolution + scan, 2 * (linears + convolution + scan))
    # Frozen in_proj and convolution weights need no weight gradient: their backward costs one forward.
    frozen = build(
        {
            **SMALL,
            **{name: {"lr_scale": 0.0} for name in ("x", "b", "c", "z", "dt")},
            "convolution": {"weight": {"lr_scale": 0.0}},
        }
    )
    in_proj = 2 * tokens * 16 * 48
    assert frozen.flops(Batch([5, 2]))[1] == 2 * linears - in_proj + convolution + 2 * scan


# ---------------------------------------------------------------------------------------------------------------------
# A hybrid model (attention + discrete Mamba 2 in a pattern) generates what its full forward predicts

HYBRID = {
    "hidden_size": 16,
    "embeddings": {"vocab_size": 32},
    "decoder": {
        "type": "pattern",
        "pattern": ["ssm", "attn", "ssm"],
        "blocks": {
            "ssm": {"mixer": {"type": "discrete_mamba_2", **SMALL}, "mlp": {"type": "none"}},
            "attn": {"mixer": {"type": "attention", "heads": 2, "head_size": 8}, "mlp": {"type": "none"}},
        },
    },
}


def test_hybrid_model_generates_its_greedy_continuation():
    model = blockzoo.build({"model": HYBRID})
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    generated = model.generate(prompts, max_new_tokens=4)
    assert [len(tokens) for tokens in generated] == [4, 4]
    # Each generated token is the argmax of the full forward over the prompt and the tokens before it.
    for prompt, new_tokens in zip(prompts, generated):
        sequence = torch.tensor([prompt + new_tokens])
        with torch.no_grad():
            logits = model(sequence)[0]
        predicted = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
        assert predicted == new_tokens
