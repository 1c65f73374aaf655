"""Against an implementation nobody on this project wrote: Hugging Face's `Qwen3NextGatedDeltaNet` (its torch
path, `torch_chunk_gated_delta_rule`, which it takes without flash-linear-attention), with our weights written in
through the qwen3_next converter section (so the regrouping of in_proj_qkvz / in_proj_ba is checked too). HF runs
one document per row, so each document of our packed batch is compared with its own HF run; its one-token decoding
path (`torch_recurrent_gated_delta_rule`) is compared with ours through a cache.

Needs `transformers` (the test oracle)."""

import pytest
import torch
from gated_delta_net_reference import AROUND_ONE, STRONG_DECAY, build

from blockzoo.layers.base import Batch
from blockzoo_gated_delta_net.huggingface import QWEN3_NEXT
from blockzoo_testing import layer_inputs

transformers = pytest.importorskip("transformers")
qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

LENGTHS = [9, 1, 70]  # the last longer than transformers' chunk of 64
CASES = {
    "grouped-values": {"key_heads": 2, "value_heads": 6, "key_head_size": 4, "value_head_size": 3},
    "one-value-head-per-key-kernel-3": {
        "key_heads": 2,
        "value_heads": 2,
        "key_head_size": 8,
        "value_head_size": 4,
        "convolution": {"kernel_size": 3},
    },
}


def _hf_layer(layer):
    config = layer.config
    hf_config = transformers.Qwen3NextConfig(
        hidden_size=16,
        linear_num_key_heads=config.key_heads,
        linear_num_value_heads=config.value_heads,
        linear_key_head_dim=config.key_head_size,
        linear_value_head_dim=config.value_head_size,
        linear_conv_kernel_dim=config.convolution.kernel_size,
        rms_norm_eps=config.normalization.epsilon,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        vocab_size=8,
    )
    hf_layer = qwen3_next.Qwen3NextGatedDeltaNet(hf_config, layer_idx=0).eval()
    ours = {name: parameter.detach() for name, parameter in layer.named_parameters()}
    theirs = {}
    for mapping in QWEN3_NEXT.weights(config):
        theirs |= dict(zip(mapping.theirs, mapping.export_tensors([ours[name] for name in mapping.ours])))
    assert set(theirs) == set(hf_layer.state_dict()), "every HF weight is set"
    hf_layer.load_state_dict(theirs)
    return hf_config, hf_layer


@pytest.mark.parametrize("case", CASES)
def test_matches_transformers_gated_delta_net(case):
    layer = build({**CASES[case], **STRONG_DECAY, "normalization": {"weight": AROUND_ONE}})
    _, hf_layer = _hf_layer(layer)
    hidden, _ = layer_inputs(sum(LENGTHS))
    with torch.no_grad():
        output = layer(hidden, Batch(LENGTHS))
        expected = torch.cat([hf_layer(document[None])[0] for document in hidden.split(LENGTHS)])
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-4)


def test_decoding_matches_transformers_recurrent_path():
    """A prompt through transformers' chunked path into its cache, then single tokens through its recurrent path,
    against our generation state."""
    layer = build({**CASES["grouped-values"], **STRONG_DECAY})
    hf_config, hf_layer = _hf_layer(layer)
    hidden, _ = layer_inputs(10)
    cache = transformers.DynamicCache(config=hf_config)
    state = layer.new_state(1, 10, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        for start, end in ((0, 7), (7, 8), (8, 9), (9, 10)):
            expected = hf_layer(hidden[None, start:end], cache=cache)[0]
            output = layer(hidden[start:end], Batch([end - start], past_lengths=[start]), state)
            torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-4, msg=f"tokens {start}:{end}")
