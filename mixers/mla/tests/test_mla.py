"""The MLA mixer on one process: against a per-token float64 loop, packed documents against separate runs,
generation (expanded and absorbed) against the full forward and against each other, the kernels' value padding,
FLOPs against a hand count, config errors."""

import pytest
import torch
from mla_reference import RANDOM_BIAS, RANDOM_NORM, SMALL, build, mla_config, reference_forward

from blockzoo.api import Batch
from blockzoo.config import ConfigError
from blockzoo_attention.kernels import TorchKernel
from blockzoo_mla import mla as mla_module
from blockzoo_testing import check_decoding, check_matches_reference, check_packed_documents, layer_inputs

LENGTHS = [5, 1, 7]
CASES = {
    "plain-query": {**SMALL},
    "low-rank-query-interleaved": {
        **SMALL,
        "query_rank": 12,
        "query_norm": RANDOM_NORM,
        "key_value_norm": RANDOM_NORM,
        "interleaved_rotary": True,
    },
    "biases-nope-scale": {
        **SMALL,
        "query_rank": 12,
        "add_linear_biases": True,
        "query_down": RANDOM_BIAS,
        "query_up": RANDOM_BIAS,
        "key_value_down": RANDOM_BIAS,
        "key_value_up": RANDOM_BIAS,
        "dense": RANDOM_BIAS,
        "rotary": {"type": "none"},
        "softmax_scale": 0.7,
    },
    "value-wider-than-query-key": {**SMALL, "nope_head_size": 2, "value_head_size": 9, "rotary": {"theta": 50.0}},
}


@pytest.mark.parametrize("case", CASES)
def test_matches_a_per_token_loop(case):
    layer = build(CASES[case])
    check_matches_reference(layer, reference_forward, lengths=LENGTHS, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_packed_documents_equal_separate_runs(case):
    check_packed_documents(build(CASES[case]), lengths=LENGTHS, tolerance={"atol": 1e-5, "rtol": 1e-5})


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("absorbed", [True, False])
def test_generation_token_by_token_equals_the_full_forward(case, absorbed):
    # The kit's schedule: a prefill of different lengths, a chunk of several tokens, then one token at a time (the
    # steps the absorbed form decodes).
    layer = build({**CASES[case], "absorbed_decoding": absorbed})
    check_decoding(layer, tolerance={"atol": 1e-5, "rtol": 1e-5})
    check_decoding(layer, tolerance={"atol": 1e-5, "rtol": 1e-5}, steps=[[1, 1]] * 4, lengths=[4, 4])


@pytest.mark.parametrize("case", CASES)
def test_absorbed_decoding_equals_the_expanded_one(case):
    absorbed, expanded = (
        build({**CASES[case], "absorbed_decoding": True}),
        build({**CASES[case], "absorbed_decoding": False}),
    )
    assert all(torch.equal(a, b) for a, b in zip(absorbed.parameters(), expanded.parameters()))
    prompts, _ = layer_inputs(2 * 6, seed=3)
    states = [layer.new_state(2, 10, torch.device("cpu"), torch.float32) for layer in (absorbed, expanded)]
    with torch.no_grad():
        for layer, state in zip((absorbed, expanded), states):
            layer(prompts[: 2 * 3], Batch([3, 3], past_lengths=[0, 0]), state)
        for step in range(3):
            token = prompts[2 * 3 + 2 * step : 2 * 3 + 2 * step + 2]
            batch = [Batch([1, 1], past_lengths=[3 + step, 3 + step]) for _ in range(2)]
            outputs = [layer(token, b, state) for layer, b, state in zip((absorbed, expanded), batch, states)]
            torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-5)
    # The absorbed path really ran: it never expands latents to keys and values; the expanded one expands the cache.
    calls = {}
    for name, layer, state in (("absorbed", absorbed, states[0]), ("expanded", expanded, states[1])):
        calls[name] = []
        layer.key_value_up.register_forward_hook(
            lambda module, args, output, name=name: calls[name].append(len(args[0]))
        )
        with torch.no_grad():
            layer(prompts[:2], Batch([1, 1], past_lengths=[6, 6]), state)
    assert calls == {"absorbed": [], "expanded": [14]}


class _OneHeadSizeKernel(TorchKernel):
    """The torch kernel under flash varlen's name, refusing what flash refuses: heads of different sizes."""

    name = "varlen"

    def attend(self, query, key, value, prepared, scale):
        assert query.shape[-1] == key.shape[-1] == value.shape[-1], (query.shape, key.shape, value.shape)
        return super().attend(query, key, value, prepared, scale)


@pytest.mark.parametrize("case", ["plain-query", "value-wider-than-query-key"])
def test_kernels_of_one_head_size_get_padded_heads(case, monkeypatch):
    # Values narrower (padded values) and wider (padded queries and keys) than the query/key heads.
    monkeypatch.setattr(mla_module, "select_kernel", lambda implementation, query: _OneHeadSizeKernel())
    layer, reference = build({**CASES[case], "implementation": "varlen"}), build(CASES[case])
    hidden, _ = layer_inputs(sum(LENGTHS))
    with torch.no_grad():
        torch.testing.assert_close(layer(hidden, Batch(LENGTHS)), reference(hidden, Batch(LENGTHS)))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*flex_attention.*")
def test_flex_kernel_pads_the_value_heads():
    """FlexAttention itself (its fast sibling: test_kernels_of_one_head_size_get_padded_heads)."""
    for case in ("plain-query", "value-wider-than-query-key"):
        layer, reference = build({**CASES[case], "implementation": "flex"}), build(CASES[case])
        hidden, _ = layer_inputs(sum(LENGTHS))
        with torch.no_grad():
            torch.testing.assert_close(layer(hidden, Batch(LENGTHS)), reference(hidden, Batch(LENGTHS)))


def test_flops_against_a_hand_count():
    # hidden 16, heads 4, query rank 12, latent 8, nope 6, rotary 4, value 5 (multiply-adds per token):
    # query_down 16·12, query_up 12·4·10, key_value_down 16·(8+4), key_value_up 8·4·(6+5), dense 4·5·16.
    layer = build({**SMALL, "query_rank": 12})
    per_token = 16 * 12 + 12 * 40 + 16 * 12 + 8 * 44 + 20 * 16
    # Causal documents of 5 and 2 tokens: 15 + 3 = 18 attended pairs, 2·heads·(10 + 5) operations each.
    pairs = 2 * 4 * 15 * 18
    assert layer.flops(Batch([5, 2])) == (2 * 7 * per_token + pairs, 4 * 7 * per_token + 2 * pairs)
    # Decoding 1 token after 4 cached: it attends to 5.
    assert layer.flops(Batch([1], past_lengths=[4]))[0] == 2 * per_token + 2 * 4 * 15 * 5


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"rotary_head_size": 3}, r"rotary_head_size: rotary embeddings rotate pairs of dims"),
        ({"rotary": {"type": "partial"}}, r"rotary: type `partial` does not apply"),
        ({"key_value_rank": 0}, r"key_value_rank"),
    ],
)
def test_config_errors_name_the_field(data, message):
    with pytest.raises(ConfigError, match=message):
        mla_config({**SMALL, **data})


def test_tensor_parallel_that_does_not_divide_heads_is_refused():
    from blockzoo.config import ConfigFieldError

    with pytest.raises(ConfigFieldError, match=r"tensor_parallel=3 must divide heads \(4\)"):
        mla_config(SMALL).check_tensor_parallel(3)
