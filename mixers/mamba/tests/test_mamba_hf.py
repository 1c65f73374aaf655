"""External oracles: Hugging Face's `MambaMixer` (Mamba 1) and `JambaMambaMixer` (Mamba 1 with RMS norms on dt, B
and C), their torch paths on the CPU, with our weights copied in. Needs the test extra (transformers); mamba_ssm
must not be importable (transformers would take its kernels)."""

import pytest
import torch
from mamba_reference import HIDDEN, build

from blockzoo.layers.base import Batch

transformers = pytest.importorskip("transformers")

RANDOM_BIAS = {"bias": {"initialization": {"type": "normal", "std": 0.5}}}
RANDOM_NORM = {"type": "rms_norm", "epsilon": 1.0e-6, "weight": {"initialization": {"type": "normal", "mean": 1.0}}}
STANDARD = {
    "state_size": 4,
    "expand": 2,
    "dt_rank": 3,
    "convolution": {"kernel_size": 3, **RANDOM_BIAS},
    "add_linear_biases": True,
    "x": RANDOM_BIAS,
    "z": RANDOM_BIAS,
    "out_proj": RANDOM_BIAS,
    "d": {"initialization": {"type": "normal", "mean": 1.0, "std": 0.5}},
}
LENGTH = 11


def _copy_weights(layer, mixer) -> None:
    """Our parameters into HF's module: the same layout, conv1d with its singleton input-channel dim."""
    with torch.no_grad():
        mixer.in_proj.weight.copy_(layer.in_proj.weight)  # rows [x; z] in both
        mixer.in_proj.bias.copy_(layer.in_proj.bias)
        mixer.conv1d.weight.copy_(layer.convolution.weight.unsqueeze(1))
        mixer.conv1d.bias.copy_(layer.convolution.bias)
        mixer.x_proj.weight.copy_(layer.x_proj.weight)
        mixer.dt_proj.weight.copy_(layer.dt_proj.weight)
        mixer.dt_proj.bias.copy_(layer.dt_bias)
        mixer.A_log.copy_(layer.a_log)
        mixer.D.copy_(layer.d)
        mixer.out_proj.weight.copy_(layer.out_proj.weight)
        mixer.out_proj.bias.copy_(layer.out_proj.bias)


def _compare(layer, mixer) -> None:
    """Two sequences as a [2, length, hidden] HF batch, and as two packed documents here."""
    hidden = torch.randn(2, LENGTH, HIDDEN, generator=torch.Generator().manual_seed(3))
    mixer.eval()
    with torch.no_grad():
        expected = mixer(hidden)
        output = layer(hidden.flatten(0, 1), Batch([LENGTH, LENGTH]))
    torch.testing.assert_close(output, expected.flatten(0, 1), atol=2e-5, rtol=1e-4)


def test_matches_hugging_face_mamba_mixer():
    from transformers.models.mamba.modeling_mamba import MambaConfig as HFMambaConfig
    from transformers.models.mamba.modeling_mamba import MambaMixer

    layer = build(STANDARD)
    hf_config = HFMambaConfig(
        hidden_size=HIDDEN,
        state_size=4,
        expand=2,
        conv_kernel=3,
        time_step_rank=3,
        use_bias=True,
        use_conv_bias=True,
        num_hidden_layers=1,
        vocab_size=32,
    )
    mixer = MambaMixer(hf_config, layer_idx=0)
    _copy_weights(layer, mixer)
    _compare(layer, mixer)


def test_matches_hugging_face_jamba_mixer_with_dt_b_c_norms():
    from transformers.models.jamba.modeling_jamba import JambaConfig, JambaMambaMixer

    layer = build({**STANDARD, "dt_norm": RANDOM_NORM, "b_norm": RANDOM_NORM, "c_norm": RANDOM_NORM})
    hf_config = JambaConfig(
        hidden_size=HIDDEN,
        mamba_d_state=4,
        mamba_expand=2,
        mamba_d_conv=3,
        mamba_dt_rank=3,
        mamba_conv_bias=True,
        mamba_proj_bias=True,
        rms_norm_eps=1.0e-6,
        num_hidden_layers=1,
        vocab_size=32,
        use_mamba_kernels=False,  # 4.x: its kernels are refused on the CPU; 5.x: ignored.
    )
    mixer = JambaMambaMixer(hf_config, layer_idx=0)
    _copy_weights(layer, mixer)
    with torch.no_grad():
        mixer.dt_layernorm.weight.copy_(layer.dt_norm.weight)
        mixer.b_layernorm.weight.copy_(layer.b_norm.weight)
        mixer.c_layernorm.weight.copy_(layer.c_norm.weight)
    _compare(layer, mixer)
