"""The Gated DeltaNet mixer on one process: the chunked delta rule against a float64 per-token loop, the layer against
a float64 reference written from the definitions, packed documents against separate runs, generation state against
the full forward, config checks, FLOPs."""

import pytest
import torch
from gated_delta_net_reference import (
    AROUND_ONE,
    RANDOM,
    SEED,
    STRONG_DECAY,
    build,
    delta_rule_loop,
    gated_delta_net_config,
    reference_forward,
)

import blockzoo_gated_delta_net.delta_rule as delta_rule_module
from blockzoo.api import Batch, ConfigError
from blockzoo_gated_delta_net.delta_rule import gated_delta_rule
from blockzoo_testing import (
    check_bf16_compute,
    check_decoding,
    check_generation_refusals,
    check_matches_reference,
    check_packed_documents,
    layer_inputs,
    parameter_shapes,
    parameters_without_weight_decay,
    single_process,
)

LENGTHS = [5, 1, 7]  # Not multiples of the chunk size (4), and a document of one token.
SMALL = {"key_heads": 2, "value_heads": 4, "key_head_size": 4, "value_head_size": 3, "chunk_size": 4}
CASES = {
    "grouped-values": {**SMALL, **STRONG_DECAY, "normalization": {"weight": AROUND_ONE}},
    "one-value-head-per-key-conv-bias": {
        **SMALL,
        **STRONG_DECAY,
        "value_heads": 2,
        "convolution": {"kernel_size": 3, "bias": {"enabled": True, **RANDOM}},
    },
    "biases-kernel-size-one-one-chunk": {
        **SMALL,
        **STRONG_DECAY,
        "chunk_size": 64,
        "add_linear_biases": True,
        "b": {"bias": RANDOM},
        "a": {"bias": RANDOM},
        "out_proj": {"bias": RANDOM},
        "convolution": {"kernel_size": 1},
        "normalization": {"epsilon": 0.1},
    },
    "default-decay": {**SMALL, "key_heads": 1},
}


def _random_inputs(tokens, key_heads, value_heads, key_size, value_size, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    q, k = normal(tokens, key_heads, key_size), normal(tokens, key_heads, key_size)
    v = normal(tokens, value_heads, value_size)
    log_decay = -torch.rand(tokens, value_heads, generator=generator, dtype=torch.float64) * 2  # α in [e^-2, 1]
    beta = torch.rand(tokens, value_heads, generator=generator, dtype=torch.float64)
    return q, k, v, log_decay, beta


def _normalized(q, k):
    q = q / q.square().sum(-1, keepdim=True).add(1e-6).sqrt() / q.shape[-1] ** 0.5
    return q, k / k.square().sum(-1, keepdim=True).add(1e-6).sqrt()


@pytest.mark.parametrize("chunk_size", [1, 3, 64])
def test_the_chunked_delta_rule_matches_a_per_token_loop(chunk_size):
    """Documents longer than several chunks, a partial last chunk, grouped values, from given states (generation)
    and to their final states, in float64."""
    lengths = [11, 2, 8]
    q, k, v, log_decay, beta = _random_inputs(sum(lengths), 2, 4, 5, 3)
    initial = torch.randn(len(lengths), 4, 5, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    state = initial.clone()
    output = gated_delta_rule(
        q, k, v, log_decay, beta, Batch(lengths, past_lengths=[0] * 3), chunk_size=chunk_size, state=state
    )
    nq, nk = _normalized(q, k)
    start = 0
    for document, length in enumerate(lengths):
        rows = slice(start, start + length)
        expected, final = delta_rule_loop(nq[rows], nk[rows], v[rows], log_decay[rows], beta[rows], initial[document])
        torch.testing.assert_close(output[rows], expected, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(state[document], final, atol=1e-10, rtol=1e-10)
        start += length


def test_one_token_steps_take_the_recurrent_form(monkeypatch):
    q, k, v, log_decay, beta = _random_inputs(3, 1, 2, 4, 3)
    state = torch.randn(3, 2, 4, 3, dtype=torch.float64)
    initial = state.clone()

    def refuse(*args, **kwargs):
        raise AssertionError("a one-token step took the chunked form")

    monkeypatch.setattr(delta_rule_module, "chunked_gated_delta_rule", refuse)
    output = gated_delta_rule(q, k, v, log_decay, beta, Batch([1, 1, 1], past_lengths=[4, 2, 7]), state=state)
    nq, nk = _normalized(q, k)
    for sequence in range(3):
        rows = slice(sequence, sequence + 1)
        expected, final = delta_rule_loop(nq[rows], nk[rows], v[rows], log_decay[rows], beta[rows], initial[sequence])
        torch.testing.assert_close(output[rows], expected, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(state[sequence], final, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("case", CASES)
def test_matches_the_float64_reference(case):
    layer = build(CASES[case])
    check_matches_reference(layer, reference_forward, lengths=LENGTHS, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("case", CASES)
def test_packed_documents_equal_separate_runs(case):
    layer = build(CASES[case])
    check_packed_documents(
        layer,
        lengths=LENGTHS,
        tolerance={"atol": 1e-5, "rtol": 1e-5},
        parameter_gradient_tolerance={"atol": 1e-5, "rtol": 1e-4},
    )


def test_parameter_names_and_shapes():
    layer = build(SMALL)
    # in_proj rows: q (2 key heads · 4) ‖ k (8) ‖ v (4 value heads · 3) ‖ z (12) ‖ b (4) ‖ a (4).
    assert parameter_shapes(layer) == {
        "in_proj.weight": (48, 16),
        "convolution.weight": (28, 4),
        "dt_bias": (4,),
        "a_log": (4,),
        "normalization.weight": (3,),
        "out_proj.weight": (16, 12),
    }


def test_default_initializations():
    layer = build({**SMALL, "key_heads": 32, "value_heads": 64})
    a = torch.exp(layer.a_log.detach())
    assert bool(((a >= 1) & (a <= 16)).all()) and float(a.std()) > 2  # uniform [1, 16]
    dt = torch.nn.functional.softplus(layer.dt_bias.detach())
    assert bool(((dt >= 1e-3 * 0.999) & (dt <= 0.1 * 1.001)).all())  # log-uniform time steps in [1e-3, 0.1]
    assert bool(layer.normalization.weight.detach().eq(1).all()) and layer.convolution.bias is None
    assert parameters_without_weight_decay(layer) == {"dt_bias", "a_log", "normalization.weight"}


@pytest.mark.parametrize("case", ["grouped-values", "one-value-head-per-key-conv-bias"])
def test_generation_state_equals_the_full_forward(case):
    layer = build(CASES[case])
    state = layer.new_state(2, 10, torch.device("cpu"), torch.float32)
    assert state.recurrent.dtype == torch.float32 and state.recurrent.shape == (2, layer.config.value_heads, 4, 3)
    # Prefill prompts of different lengths (longer than a chunk), a chunk of several tokens, then one token at a time.
    steps = [[5, 2], [2, 1], [1, 1], [1, 1], [1, 1]]
    check_decoding(layer, tolerance={"atol": 1e-5, "rtol": 1e-5}, lengths=[10, 6], steps=steps)


def test_bf16_compute_is_close_to_fp32():
    """Activations in bf16 (master weights fp32): the output keeps the dtype, gradients reach fp32 weights."""
    layer = build(CASES["grouped-values"], single_process(SEED, compute_dtype="bf16"))
    check_bf16_compute(layer, build(CASES["grouped-values"]), lengths=LENGTHS)


def test_generation_state_errors():
    layer = build(SMALL)
    check_generation_refusals(layer)


def test_chunk_size_changes_only_rounding():
    hidden, _ = layer_inputs(sum(LENGTHS))
    outputs = []
    for chunk_size in (1, 3, 64):
        with torch.no_grad():
            outputs.append(build({**CASES["grouped-values"], "chunk_size": chunk_size})(hidden, Batch(LENGTHS)))
    for output in outputs[1:]:
        torch.testing.assert_close(output, outputs[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"value_heads": 3}, r"value_heads: must be a multiple of key_heads \(2\), got 3"),
        ({"b": {"bias": {"enabled": True}}}, r"b\.bias\.enabled: q, k, v, z, b and a are one fused in_proj weight"),
    ],
)
def test_config_errors_name_the_field(change, message):
    with pytest.raises(ConfigError, match=message):
        gated_delta_net_config({**SMALL, **change})


def test_flops_against_a_hand_count():
    # hidden 16; q, k 2 · 4; v, z 4 · 3; b, a 4; kernel 4 over q‖k‖v (28 channels).
    layer = build(SMALL)
    tokens = 7
    in_proj = 2 * tokens * 16 * 48
    out_proj = 2 * tokens * 12 * 16
    convolution = 2 * tokens * 4 * 28
    recurrence = 7 * tokens * 4 * 4 * 3
    forward = in_proj + out_proj + convolution + recurrence
    assert layer.flops(Batch([5, 2])) == (forward, 2 * forward)
    frozen = build({**SMALL, "lr_scale": 0.0})  # no weight gradients: the backward computes the inputs' only
    assert frozen.flops(Batch([5, 2]))[1] == in_proj + out_proj + convolution + 2 * recurrence
