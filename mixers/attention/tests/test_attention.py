"""The attention mixer on one process: against a plain per-token loop, packed documents against separate runs,
KV-cache decoding against the full forward, every config field, FLOPs, kernel choice."""

import warnings

import attrs
import pytest
import torch
from attention_reference import build, reference_forward

from blockzoo.layers.base import Batch
from blockzoo_attention.config import AttentionConfig
from blockzoo_attention.kernels import KERNELS, Segments, TorchKernel, select_kernel
from blockzoo_testing import (
    check_decoding,
    check_generation_refusals,
    check_matches_reference,
    check_packed_documents,
    layer_inputs,
    layer_signature,
)

LENGTHS = [5, 1, 7]
# Biases and norm weights start at zeros and ones by default: give them values so that they matter.
RANDOM_BIAS = {"bias": {"initialization": {"type": "normal", "std": 0.5}}}
RANDOM_NORM = {"weight": {"initialization": {"type": "normal", "mean": 1.0, "std": 0.3}}}
SMALL = {"heads": 4, "head_size": 8}
CASES = {
    "mha-default-rotary": {**SMALL},
    "gqa-window-llama3": {
        **SMALL,
        "head_groups": 2,
        "window_size": 3,
        "rotary": {"type": "llama3", "theta": 100.0, "original_context_length": 64, "scale_factor": 4.0},
    },
    "mqa-yarn-softmax-scale": {
        **SMALL,
        "head_groups": 1,
        "softmax_scale": 0.9,
        "key_multiplier": 0.7,
        "rotary": {"type": "yarn", "theta": 100.0, "original_context_length": 4, "scale_factor": 4.0},
    },
    "qkv-biases-without-dense-bias-norms-nope": {
        **SMALL,
        "head_groups": 2,
        "add_linear_biases": True,
        "query": RANDOM_BIAS,
        "key": RANDOM_BIAS,
        "value": RANDOM_BIAS,
        "dense": {"bias": {"enabled": False}},
        "query_norm": {"type": "rms_norm", **RANDOM_NORM},
        "key_norm": {"type": "layer_norm", **RANDOM_NORM, "bias": {"initialization": {"type": "normal"}}},
        "rotary": {"type": "none"},
    },
    "non-causal-gqa": {**SMALL, "head_groups": 2, "causal": False, "rotary": {"theta": 50.0}},
    "gqa-output-gate-with-bias": {
        **SMALL,
        "head_groups": 2,
        "output_gate": {"bias": {"enabled": True, "initialization": {"type": "normal", "std": 0.5}}},
    },
}


@pytest.mark.parametrize("case", CASES)
def test_matches_a_per_token_loop(case):
    layer = build(CASES[case])
    check_matches_reference(layer, reference_forward, lengths=LENGTHS, atol=2e-6, rtol=1e-5)


def test_qkv_biases_without_dense_bias():
    layer = build(CASES["qkv-biases-without-dense-bias-norms-nope"])
    assert layer.query.bias is not None and layer.key_value.bias is not None and layer.dense.bias is None
    assert layer.key_value.bias.shape == (2 * 2 * 8,)


@pytest.mark.parametrize("chunk_tokens", [512, 4], ids=["one-chunk", "chunked"])
@pytest.mark.parametrize("case", CASES)
def test_packed_documents_equal_separate_runs(case, chunk_tokens, monkeypatch):
    # The CPU kernel attends over chunks of whole documents; small chunks split this batch into several.
    monkeypatch.setattr(TorchKernel, "chunk_tokens", chunk_tokens)
    check_packed_documents(
        build(CASES[case]),
        lengths=LENGTHS,
        tolerance={"atol": 1e-6, "rtol": 1e-5},
        parameter_gradient_tolerance={"atol": 1e-5, "rtol": 1e-5},
    )


@pytest.mark.parametrize(
    "case", ["gqa-window-llama3", "qkv-biases-without-dense-bias-norms-nope", "gqa-output-gate-with-bias"]
)
def test_kv_cache_decoding_equals_the_full_forward(case):
    # Prefill prompts of different lengths, a chunk of several tokens, then one token at a time.
    steps = [[3, 2], [2, 1], [1, 1], [1, 1], [1, 1]]
    check_decoding(build(CASES[case]), tolerance={"atol": 1e-6, "rtol": 1e-5}, lengths=[8, 6], steps=steps)
    # One sequence: the one-token steps read its keys without a mask (but past a window's reach, with one).
    check_decoding(build(CASES[case]), tolerance={"atol": 1e-6, "rtol": 1e-5}, lengths=[9], steps=[[2]] + [[1]] * 7)


def test_kv_cache_errors():
    layer = build(SMALL)
    state = check_generation_refusals(layer, holder="cache")
    hidden, _ = layer_inputs(3)
    with pytest.raises(ValueError, match="sequences of up to 5 tokens exceed the cache's 4"):
        layer(hidden, Batch([2, 1], past_lengths=[3, 0]), state)
    with pytest.raises(ValueError, match="generation needs causal attention"):
        build({**SMALL, "causal": False}).new_state(1, 4, torch.device("cpu"), torch.float32)


# ---------------------------------------------------------------------------------------------------------------------
# Every field of the config changes the parameters or the forward pass

FIELD_CHANGES = {
    "heads": {"heads": 8},
    "head_groups": {"head_groups": 2},
    "head_size": {"head_size": 4},
    "query": {"query": {"weight": {"initialization": {"type": "uniform"}}}},
    "key": {"key": {"weight": {"initialization": {"type": "uniform"}}}},
    "value": {"value": {"lr_scale": 0.5}},
    "dense": {"dense": {"bias": {"enabled": True}}},
    "add_linear_biases": {"add_linear_biases": True},
    "rotary": {"rotary": {"type": "none"}},
    "causal": {"causal": False},
    "window_size": {"window_size": 2},
    "softmax_scale": {"softmax_scale": 0.5},
    "key_multiplier": {"key_multiplier": 0.5},
    "query_norm": {"query_norm": {"type": "rms_norm"}},
    "key_norm": {"key_norm": {"type": "rms_norm"}},
    "output_gate": {"output_gate": {}},
    "lr_scale": {"lr_scale": 0.0},
}


def test_every_field_changes_parameters_or_outputs():
    declared = {field.name for field in attrs.fields(AttentionConfig)}
    assert declared == {*FIELD_CHANGES, "implementation"}, "a field without a test case"
    base_config = {**SMALL, "head_groups": 4}
    base = layer_signature(build(base_config), LENGTHS)
    for name, change in FIELD_CHANGES.items():
        layer = build({**base_config, **change})
        assert layer.config.explicit_fields() >= set(change)
        assert layer_signature(layer, LENGTHS).differs_from(base), f"changing {name} changed nothing"
    hidden, _ = layer_inputs(sum(LENGTHS))
    # `implementation` picks the kernel: on a CPU, varlen is refused and flex runs (forward only).
    with pytest.raises(RuntimeError, match="implementation 'varlen' cannot run here: it needs CUDA"):
        build({**base_config, "implementation": "varlen"})(hidden, Batch(LENGTHS))


def test_value_config_is_honoured_for_its_rows():
    layer = build({**SMALL, "value": {"lr_scale": 0.5, "weight": {"initialization": {"type": "fill", "value": 0.25}}}})
    rows = layer.key_value.weight.meta.lr_scale_rows().flatten()
    assert rows[:32].eq(1.0).all() and rows[32:].eq(0.5).all()
    weight = layer.key_value.weight.detach()
    assert weight[32:].eq(0.25).all() and not weight[:32].eq(0.25).any()


@pytest.mark.parametrize("case", ["gqa-window-llama3", "non-causal-gqa"])
def test_flex_kernel_matches_the_torch_kernel_on_cpu(case):
    hidden, _ = layer_inputs(sum(LENGTHS))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FlexAttention warns that it runs uncompiled.
        flex = build({**CASES[case], "implementation": "flex"})(hidden, Batch(LENGTHS))
    with torch.no_grad():
        reference = build({**CASES[case], "implementation": "torch"})(hidden, Batch(LENGTHS))
    torch.testing.assert_close(flex, reference, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("key_heads", [4, 2, 1])
def test_batched_kernel_on_documents_of_one_length_matches_the_torch_kernel(causal, key_heads):
    """The batched path (SDPA over [documents, heads, length, head_size]) is device-independent: checked here on the
    CPU, forward and backward, against the masked torch kernel; other layouts take varlen's preparation."""
    generator = torch.Generator().manual_seed(0)
    lengths = [6, 6, 6]
    query = torch.randn(18, 4, 8, generator=generator, requires_grad=True)
    key, value = (torch.randn(18, key_heads, 8, generator=generator, requires_grad=True) for _ in range(2))
    segments = Segments.of(Batch(lengths))
    batched, plain = KERNELS["batched"], KERNELS["torch"]
    prepared = batched.prepare(segments, segments, causal, None)
    assert "documents" in prepared
    output = batched.attend(query, key, value, prepared, 0.3)
    expected = plain.attend(query, key, value, plain.prepare(segments, segments, causal, None), 0.3)
    torch.testing.assert_close(output, expected, atol=1e-6, rtol=1e-5)
    gradient = torch.randn(output.shape, generator=generator)
    actual = torch.autograd.grad(output, (query, key, value), gradient)
    for got, wanted in zip(actual, torch.autograd.grad(expected, (query, key, value), gradient)):
        torch.testing.assert_close(got, wanted, atol=1e-5, rtol=1e-5)
    mixed = Segments.of(Batch([5, 7, 6]))
    assert "documents" not in batched.prepare(mixed, mixed, causal, None)
    assert "documents" not in batched.prepare(segments, segments, causal, 3)


def test_auto_picks_the_torch_kernel_on_cpu():
    query = torch.zeros(3, 2, 8)
    assert select_kernel("auto", query) is KERNELS["torch"]
    assert KERNELS["varlen"].unavailable(query) == "it needs CUDA"
    with pytest.raises(RuntimeError, match="implementation 'varlen' cannot run here: it needs CUDA"):
        select_kernel("varlen", query)


def test_a_compiled_mixer_traces_into_one_graph(monkeypatch):
    """torch.compile traces the mixer's forward and backward, on the path a GPU takes for whole rows (SDPA over
    `[documents, heads, length, head_size]`, made available here on the CPU), without a graph break: a break (the
    plugin registry reached from the forward, once) splits every compiled block into several graphs, whose borders
    cost copies and gradient sums on the GPU, and keeps more activations."""
    monkeypatch.setattr(type(KERNELS["batched"]), "unavailable", lambda self, query: None)
    mixer = build({**SMALL, "implementation": "batched", "head_groups": 2})
    hidden, _ = layer_inputs(2 * 6)
    batches = iter([Batch([6, 6]) for _ in range(3)])  # a fresh one per call (its tables are computed inside)

    def step(hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
        return mixer(hidden, batch).square().sum()

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(step)(hidden.clone().requires_grad_(), next(batches))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    leaves = [hidden.clone().requires_grad_() for _ in range(2)]
    torch.compile(step, backend="aot_eager")(leaves[0], next(batches)).backward()
    step(leaves[1], next(batches)).backward()
    torch.testing.assert_close(leaves[0].grad, leaves[1].grad)


def test_rotary_tables_are_shared_only_by_equal_settings():
    batch = Batch(LENGTHS)
    hidden, _ = layer_inputs(sum(LENGTHS))
    with torch.no_grad():
        build({**SMALL, "rotary": {"theta": 100.0}})(hidden, batch)
        build({**SMALL, "rotary": {"theta": 100.0}})(hidden, batch)
        build({**SMALL, "rotary": {"theta": 200.0}})(hidden, batch)
        build({**SMALL, "head_size": 4, "rotary": {"theta": 100.0}})(hidden, batch)
    rotary_keys = [key for key in batch._preprocessed if key[0] == "blockzoo_attention.rotary"]
    assert len(rotary_keys) == 3


# ---------------------------------------------------------------------------------------------------------------------
# FLOPs


def test_flops_against_a_hand_count():
    # hidden 16; query 16→32, key‖value 16→(2 groups·8)·2 = 32, dense 32→16: 1536 multiply-adds per token.
    tokens = 7
    linear_forward = 2 * tokens * (16 * 32 + 16 * 32 + 32 * 16)
    window = build({**SMALL, "head_groups": 2, "window_size": 3})
    # Causal, window 3: a document of 5 sees 1+2+3+3+3 keys, one of 2 sees 1+2: 15 pairs; 4·heads·head_size each.
    pairs_flops = 4 * 4 * 8 * 15
    assert window.flops(Batch([5, 2])) == (linear_forward + pairs_flops, 2 * linear_forward + 2 * pairs_flops)
    full = build({**SMALL, "head_groups": 2, "causal": False})
    assert full.flops(Batch([5, 2])) == (linear_forward + 4 * 4 * 8 * 29, 2 * (linear_forward + 4 * 4 * 8 * 29))
    # Generating 2 tokens after 4 cached ones: positions 4 and 5 see 5 and 6 keys.
    decode = build({**SMALL, "head_groups": 2}).flops(Batch([2], past_lengths=[4]))
    assert decode[0] == 2 * 2 * 1536 + 4 * 4 * 8 * 11
    # A frozen projection needs no weight gradient: its backward costs one forward.
    frozen = build({**SMALL, "head_groups": 2, "window_size": 3, "query": {"lr_scale": 0.0}})
    assert frozen.flops(Batch([5, 2]))[1] == 2 * linear_forward - 2 * tokens * 16 * 32 + 2 * pairs_flops


def test_hidden_size_differs_from_heads_times_head_size():
    layer = build({"heads": 3, "head_groups": 1, "head_size": 6}, hidden=10)
    output = check_matches_reference(layer, reference_forward, lengths=[4, 2], atol=2e-6, rtol=1e-5)
    assert output.shape == (6, 10) and layer.query.weight.shape == (18, 10) and layer.dense.weight.shape == (10, 18)
