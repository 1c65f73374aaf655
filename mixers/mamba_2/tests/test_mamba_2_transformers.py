"""Against an implementation nobody on this project wrote: Hugging Face's `Mamba2Mixer` (its torch path), with our
weights copied in. HF runs one document per row, so each document of our packed batch is compared with its own HF
run. Its gated norm changed between releases: transformers up to 5.18 at least normalizes over the whole inner
dimension (our `normalization.per_group: false`), 5.24 per group (`per_group: true`, mamba_ssm's); the test follows
the installed one.

Needs `transformers` (the test extra). HF switches to mamba_ssm's kernels whenever mamba_ssm imports, and those do not
run on the CPU: this file runs where mamba_ssm is not installed (the CPU test environment)."""

import importlib.util
import inspect

import pytest
import torch
from mamba_2_reference import AROUND_ONE, RANDOM, build

from blockzoo.layers.base import Batch
from blockzoo_testing import layer_inputs

transformers = pytest.importorskip("transformers")
if importlib.util.find_spec("mamba_ssm") is not None:
    pytest.skip("transformers takes mamba_ssm's CUDA-only kernels when it is installed", allow_module_level=True)

LENGTHS = [9, 1, 6]


def _hf_norm_is_per_group() -> bool:
    from transformers.models.mamba2 import modeling_mamba2

    # Mamba2RMSNormGated since transformers 5.25, MambaRMSNormGated before.
    norm = getattr(modeling_mamba2, "Mamba2RMSNormGated", None) or modeling_mamba2.MambaRMSNormGated
    return "group_size" in inspect.signature(norm).parameters


CASES = {
    "two-groups-biases": {
        "groups": 2,
        "add_linear_biases": True,
        "z": {"bias": RANDOM},
        "dt": {"bias": RANDOM},
        "out_proj": {"bias": RANDOM},
    },
    "one-group-dt-limit": {"groups": 1, "dt_limit": [0.05, 0.6]},
}


def _hf_mixer(layer):
    config = layer.config
    hf_config = transformers.Mamba2Config(
        hidden_size=16,
        expand=2,  # hidden · expand = heads · head_size
        num_heads=config.heads,
        head_dim=config.head_size,
        n_groups=config.groups,
        state_size=config.state_size,
        chunk_size=config.chunk_size,
        conv_kernel=config.convolution.kernel_size,
        use_bias=config.add_linear_biases,
        use_conv_bias=config.convolution.has_bias,
        time_step_limit=tuple(config.dt_limit),
        layer_norm_epsilon=config.normalization.epsilon,
        vocab_size=8,
        num_hidden_layers=1,
    )
    mixer = transformers.models.mamba2.modeling_mamba2.Mamba2Mixer(hf_config, layer_idx=0).eval()
    ours = {name: parameter.detach() for name, parameter in layer.named_parameters()}
    copies = {
        "in_proj.weight": ours["in_proj.weight"],
        "conv1d.weight": ours["convolution.weight"].unsqueeze(1),
        "conv1d.bias": ours["convolution.bias"],
        "dt_bias": ours["dt_bias"],
        "A_log": ours["a_log"],
        "D": ours["d"],
        "norm.weight": ours["normalization.weight"],
        "out_proj.weight": ours["out_proj.weight"],
    }
    if config.add_linear_biases:
        copies |= {"in_proj.bias": ours["in_proj.bias"], "out_proj.bias": ours["out_proj.bias"]}
    state = mixer.state_dict()
    assert set(copies) == set(state), "every HF weight is set"
    mixer.load_state_dict(copies)
    return mixer


@pytest.mark.parametrize("case", CASES)
def test_matches_transformers_mamba2_mixer(case):
    data = {
        "heads": 4,
        "head_size": 8,
        "state_size": 3,
        "chunk_size": 4,
        "dt_bias": {"initialization": {"type": "normal", "std": 1.0}},
        "d": AROUND_ONE,
        "normalization": {"per_group": _hf_norm_is_per_group(), "weight": AROUND_ONE},
        "convolution": {"bias": RANDOM},
        **CASES[case],
    }
    layer = build(data)
    mixer = _hf_mixer(layer)
    hidden, _ = layer_inputs(sum(LENGTHS))
    with torch.no_grad():
        output = layer(hidden, Batch(LENGTHS))
        expected = torch.cat([mixer(document[None])[0] for document in hidden.split(LENGTHS)])
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-4)
