"""blockzoo_ssm on the CPU: every function against a float64 step-by-step reference written here (plain loops over
time per document), gradients (gradcheck in float64), generation state, the initializations and the mamba_ssm adapter.

The references index groups explicitly (head h reads group h // (heads // groups)) and restart the state at every
document, so the packed functions are checked against documents run one by one.
"""

import math
import subprocess
import sys
import textwrap
import types
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from blockzoo.config import ConfigError, structure
from blockzoo.distributed.config import DistributedConfig
from blockzoo.distributed.runtime import Distributed
from blockzoo.layers.base import Batch
from blockzoo.layers.config import InitializationConfig, ResolvedParameter
from blockzoo.layers.dims import TensorDim
from blockzoo.layers.parameter import create_parameter
from blockzoo.plugins import get_registry
from blockzoo_ssm import (
    ALogRangeInitializationConfig,
    ALogStateInitializationConfig,
    DtBiasInitializationConfig,
    causal_conv1d,
    gated_rms_norm,
    import_mamba_ssm,
    kernels,
    mamba_ssm_available,
    selective_scan,
    ssd_scan,
)
from blockzoo_ssm import scan as scan_module
from blockzoo_ssm.initialization import initialize_a_log_range, initialize_a_log_state, initialize_dt_bias

F64 = torch.float64
LENGTHS = [7, 1, 13, 6]  # None a multiple of the chunk sizes 4 and 5, and a one-token document.


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _split(tensor: torch.Tensor, lengths) -> list[torch.Tensor]:
    return list(torch.split(tensor, list(lengths)))


# ---------------------------------------------------------------------------------------------------------------------
# References: float64, one document at a time, one token at a time.


def reference_ssd(x, dt, A, B, C, lengths, *, scale_input=True, initial=None):
    """Returns (y [tokens, heads, head_size], final states [documents, heads, head_size, state])."""
    x, dt, A, B, C = (t.to(F64) for t in (x, dt, A, B, C))
    heads, groups = x.shape[1], B.shape[1]
    group_of = [h // (heads // groups) for h in range(heads)]
    outputs, finals = [], []
    for document, (xs, dts, Bs, Cs) in enumerate(zip(*(_split(t, lengths) for t in (x, dt, B, C)))):
        state = torch.zeros(heads, x.shape[2], B.shape[2], dtype=F64)
        if initial is not None:
            state = initial[document].to(F64).clone()
        for t in range(len(xs)):
            scale = dts[t] if scale_input else torch.ones(heads, dtype=F64)
            for h in range(heads):
                state[h] = torch.exp(dts[t, h] * A[h]) * state[h] + scale[h] * torch.outer(xs[t, h], Bs[t, group_of[h]])
            outputs.append(torch.stack([state[h] @ Cs[t, group_of[h]] for h in range(heads)]))
        finals.append(state)
    return torch.stack(outputs), torch.stack(finals)


def reference_selective(u, delta, A, B, C, lengths, *, initial=None):
    """Returns (y [tokens, channels], final states [documents, channels, state])."""
    u, delta, A, B, C = (t.to(F64) for t in (u, delta, A, B, C))
    channels, groups = u.shape[1], B.shape[1]
    group_of = torch.tensor([d // (channels // groups) for d in range(channels)])
    outputs, finals = [], []
    for document, (us, deltas, Bs, Cs) in enumerate(zip(*(_split(t, lengths) for t in (u, delta, B, C)))):
        state = torch.zeros(channels, A.shape[1], dtype=F64) if initial is None else initial[document].to(F64)
        for t in range(len(us)):
            state = torch.exp(deltas[t, :, None] * A) * state + (deltas[t] * us[t])[:, None] * Bs[t, group_of]
            outputs.append((state * Cs[t, group_of]).sum(-1))
        finals.append(state)
    return torch.stack(outputs), torch.stack(finals)


def reference_conv(x, weight, bias, lengths, *, activation=None, initial=None):
    """Returns (y [tokens, channels], final states [documents, channels, kernel_size - 1])."""
    x, weight = x.to(F64), weight.to(F64)
    kernel_size = weight.shape[1]
    outputs, finals = [], []
    for document, xs in enumerate(_split(x, lengths)):
        stored = torch.zeros(x.shape[1], kernel_size - 1, dtype=F64) if initial is None else initial[document].to(F64)
        for t in range(len(xs)):
            total = torch.zeros(x.shape[1], dtype=F64) if bias is None else bias.to(F64).clone()
            for j in range(kernel_size):
                if t - j >= 0:
                    total += weight[:, kernel_size - 1 - j] * xs[t - j]
                else:  # before the document: the stored inputs, the last of which is position -1
                    total += weight[:, kernel_size - 1 - j] * stored[:, kernel_size - 1 + (t - j)]
            outputs.append(F.silu(total) if activation == "silu" else total)
        finals.append(torch.cat([stored, xs.T], 1)[:, len(xs) :])
    return torch.stack(outputs), torch.stack(finals)


def reference_norm(x, gate, weight, *, epsilon, group_size):
    x, weight = x.to(F64), weight.to(F64)
    output = torch.empty_like(x)
    for t in range(x.shape[0]):
        for start in range(0, x.shape[1], group_size):
            group = slice(start, start + group_size)
            values = x[t, group] if gate is None else x[t, group] * F.silu(gate[t, group].to(F64))
            output[t, group] = values / torch.sqrt((values**2).mean() + epsilon) * weight[group]
    return output


# ---------------------------------------------------------------------------------------------------------------------
# Inputs


def ssd_inputs(lengths, heads=4, head_size=3, groups=2, state_size=5, dtype=F64, seed=0):
    generator, tokens = _generator(seed), sum(lengths)
    x = torch.randn(tokens, heads, head_size, generator=generator, dtype=F64)
    dt = torch.rand(tokens, heads, generator=generator, dtype=F64) * 0.9 + 0.1
    A = -(torch.rand(heads, generator=generator, dtype=F64) * 1.5 + 0.2)
    B = torch.randn(tokens, groups, state_size, generator=generator, dtype=F64)
    C = torch.randn(tokens, groups, state_size, generator=generator, dtype=F64)
    return [t.to(dtype) for t in (x, dt, A, B, C)]


def selective_inputs(lengths, channels=6, groups=2, state_size=4, dtype=F64, seed=0):
    generator, tokens = _generator(seed), sum(lengths)
    u = torch.randn(tokens, channels, generator=generator, dtype=F64)
    delta = torch.rand(tokens, channels, generator=generator, dtype=F64) * 0.9 + 0.1
    A = -(torch.rand(channels, state_size, generator=generator, dtype=F64) * 1.5 + 0.2)
    B = torch.randn(tokens, groups, state_size, generator=generator, dtype=F64)
    C = torch.randn(tokens, groups, state_size, generator=generator, dtype=F64)
    return [t.to(dtype) for t in (u, delta, A, B, C)]


def conv_inputs(lengths, channels=5, kernel_size=4, dtype=F64, seed=0):
    generator = _generator(seed)
    x = torch.randn(sum(lengths), channels, generator=generator, dtype=F64)
    weight = torch.randn(channels, kernel_size, generator=generator, dtype=F64)
    bias = torch.randn(channels, generator=generator, dtype=F64)
    return x.to(dtype), weight.to(dtype), bias.to(dtype)


# ---------------------------------------------------------------------------------------------------------------------
# ssd_scan


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 64])
@pytest.mark.parametrize("scale_input", [True, False])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_ssd_scan_matches_the_step_by_step_recurrence(chunk_size, scale_input, groups):
    x, dt, A, B, C = ssd_inputs(LENGTHS, groups=groups)
    y = ssd_scan(x, dt, A, B, C, Batch(LENGTHS), chunk_size=chunk_size, scale_input=scale_input)
    expected, _ = reference_ssd(x, dt, A, B, C, LENGTHS, scale_input=scale_input)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("scale_input", [True, False])
def test_ssd_scan_adds_the_skip(per_channel, scale_input):
    x, dt, A, B, C = ssd_inputs(LENGTHS, groups=2)
    skip = torch.randn(
        x.shape[1:] if per_channel else x.shape[1:2], dtype=F64, generator=torch.Generator().manual_seed(7)
    )
    y = ssd_scan(x, dt, A, B, C, Batch(LENGTHS), chunk_size=4, D=skip, scale_input=scale_input)
    expected, _ = reference_ssd(x, dt, A, B, C, LENGTHS, scale_input=scale_input)
    expected = expected + (skip if per_channel else skip[:, None]) * x  # y_t += D·x_t, per head or per channel
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="D must be"):
        ssd_scan(x, dt, A, B, C, Batch(LENGTHS), chunk_size=4, D=skip[:1])


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_ssd_scan_keeps_the_input_dtype_and_accumulates_in_fp32(dtype, tolerance):
    inputs = ssd_inputs(LENGTHS, dtype=dtype)
    y = ssd_scan(*inputs, Batch(LENGTHS), chunk_size=4)
    expected, _ = reference_ssd(*inputs, LENGTHS)
    assert y.dtype == dtype
    assert (y.to(F64) - expected).norm() / expected.norm() < tolerance


def test_ssd_scan_long_chunks_stay_accurate_in_fp32():
    # A long chunk with a large total decay: decays between nearby tokens taken as differences of cumulative sums
    # (hundreds) would lose their last digits in fp32 (relative error 2e-6 here, against 8e-8 when summed directly).
    lengths = [256]
    x, dt, A, B, C = ssd_inputs(lengths, heads=2, groups=1)
    A = torch.full_like(A, -2.0)
    y = ssd_scan(*(t.float() for t in (x, dt, A, B, C)), Batch(lengths), chunk_size=256)
    expected, _ = reference_ssd(x, dt, A, B, C, lengths)
    assert (y.to(F64) - expected).norm() / expected.norm() < 5e-7


@pytest.mark.parametrize("scale_input", [True, False])
def test_ssd_scan_gradients(scale_input):
    lengths = [3, 1, 2]
    inputs = [t.requires_grad_() for t in ssd_inputs(lengths, heads=2, head_size=2, groups=2, state_size=2)]
    batch = Batch(lengths)
    # fast_mode checks random projections of the Jacobian (one directional derivative per input), not every entry.
    assert torch.autograd.gradcheck(
        lambda *tensors: ssd_scan(*tensors, batch, chunk_size=2, scale_input=scale_input), inputs, fast_mode=True
    )


@pytest.mark.parametrize("chunk_size", [2, 64])
def test_ssd_scan_generation_state(chunk_size):
    lengths = [8, 5, 9]
    x, dt, A, B, C = ssd_inputs(lengths)
    expected, expected_final = reference_ssd(x, dt, A, B, C, lengths)
    state = torch.zeros(len(lengths), x.shape[1], x.shape[2], B.shape[2], dtype=F64)
    outputs = _generate(
        lambda part, batch: ssd_scan(*part, batch, chunk_size=chunk_size, state=state), (x, dt, B, C), lengths, A
    )
    torch.testing.assert_close(outputs, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, expected_final, rtol=1e-12, atol=1e-12)


def test_ssd_scan_reads_the_given_state():
    lengths = [3, 6]
    x, dt, A, B, C = ssd_inputs(lengths)
    initial = torch.randn(len(lengths), x.shape[1], x.shape[2], B.shape[2], generator=_generator(1), dtype=F64)
    state = initial.clone()
    y = ssd_scan(x, dt, A, B, C, Batch(lengths, past_lengths=[4, 2]), chunk_size=4, scale_input=False, state=state)
    expected, expected_final = reference_ssd(x, dt, A, B, C, lengths, scale_input=False, initial=initial)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, expected_final, rtol=1e-12, atol=1e-12)


def _generate(step, sequence_tensors, lengths, *constants):
    """Run `step` on a prefix of each sequence, then a piece of each, then token by token to the end; return the
    outputs in the packed order of the whole sequences."""
    prefix = [3, 1, 5]
    piece = [2, 1, 1]
    remaining = [length - p - q for length, p, q in zip(lengths, prefix, piece)]
    assert len(set(remaining)) == 1, "every sequence must have the same number of tokens left"
    steps = [prefix, piece] + [[1] * len(lengths)] * remaining[0]
    outputs = [[] for _ in lengths]
    done = [0] * len(lengths)
    for step_lengths in steps:
        parts = []
        for tensor in sequence_tensors:
            documents = _split(tensor, lengths)
            parts.append(torch.cat([d[s : s + n] for d, s, n in zip(documents, done, step_lengths)]))
        batch = Batch(step_lengths, past_lengths=list(done))
        output = step((parts[0], parts[1], *constants, *parts[2:]), batch)
        for index, piece_output in enumerate(_split(output, step_lengths)):
            outputs[index].append(piece_output)
        done = [d + n for d, n in zip(done, step_lengths)]
    return torch.cat([torch.cat(pieces) for pieces in outputs])


# ---------------------------------------------------------------------------------------------------------------------
# selective_scan


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_selective_scan_matches_the_step_by_step_recurrence(groups):
    inputs = selective_inputs(LENGTHS, groups=groups)
    y = selective_scan(*inputs, Batch(LENGTHS))
    expected, _ = reference_selective(*inputs, LENGTHS)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_selective_scan_keeps_the_input_dtype(dtype, tolerance):
    inputs = selective_inputs(LENGTHS, dtype=dtype)
    y = selective_scan(*inputs, Batch(LENGTHS))
    expected, _ = reference_selective(*inputs, LENGTHS)
    assert y.dtype == dtype
    assert (y.to(F64) - expected).norm() / expected.norm() < tolerance


def test_selective_scan_gradients():
    lengths = [3, 1, 2]
    inputs = [t.requires_grad_() for t in selective_inputs(lengths, channels=4, groups=2, state_size=2)]
    batch = Batch(lengths)
    assert torch.autograd.gradcheck(lambda *tensors: selective_scan(*tensors, batch), inputs)


def test_selective_scan_generation_state():
    lengths = [8, 5, 9]
    u, delta, A, B, C = selective_inputs(lengths)
    expected, expected_final = reference_selective(u, delta, A, B, C, lengths)
    state = torch.zeros(len(lengths), *A.shape, dtype=F64)
    outputs = _generate(lambda part, batch: selective_scan(*part, batch, state=state), (u, delta, B, C), lengths, A)
    torch.testing.assert_close(outputs, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, expected_final, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------------
# causal_conv1d


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("kernel_size", [1, 4])
def test_causal_conv1d_matches_the_step_by_step_convolution(with_bias, activation, kernel_size):
    x, weight, bias = conv_inputs(LENGTHS, kernel_size=kernel_size)
    bias = bias if with_bias else None
    y = causal_conv1d(x, weight, bias, Batch(LENGTHS), activation=activation)
    expected, _ = reference_conv(x, weight, bias, LENGTHS, activation=activation)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv1d_keeps_the_input_dtype(dtype):
    x, weight, bias = conv_inputs(LENGTHS, dtype=dtype)
    y = causal_conv1d(x, weight, bias, Batch(LENGTHS), activation="silu")
    expected, _ = reference_conv(x, weight, bias, LENGTHS, activation="silu")
    assert y.dtype == dtype
    torch.testing.assert_close(y.to(F64), expected, rtol=1e-2, atol=1e-2)


def test_causal_conv1d_gradients():
    lengths = [3, 1, 4]
    inputs = [t.requires_grad_() for t in conv_inputs(lengths, channels=3, kernel_size=3)]
    batch = Batch(lengths)
    assert torch.autograd.gradcheck(lambda *tensors: causal_conv1d(*tensors, batch, activation="silu"), inputs)


@pytest.mark.parametrize("kernel_size", [1, 2, 4])
def test_causal_conv1d_generation_state(kernel_size):
    lengths = [8, 5, 9]
    x, weight, bias = conv_inputs(lengths, kernel_size=kernel_size)
    expected, expected_final = reference_conv(x, weight, bias, lengths, activation="silu")
    state = torch.zeros(len(lengths), x.shape[1], kernel_size - 1, dtype=F64)

    def step(part, batch):
        return causal_conv1d(part[0], weight, bias, batch, activation="silu", state=state)

    outputs = _generate(step, (x, x), lengths)
    torch.testing.assert_close(outputs, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, expected_final, rtol=1e-12, atol=1e-12)


def test_causal_conv1d_reads_the_given_state():
    lengths = [2, 6]
    x, weight, _ = conv_inputs(lengths)
    initial = torch.randn(len(lengths), x.shape[1], 3, generator=_generator(1), dtype=F64)
    state = initial.clone()
    y = causal_conv1d(x, weight, None, Batch(lengths, past_lengths=[5, 3]), state=state)
    expected, expected_final = reference_conv(x, weight, None, lengths, initial=initial)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, expected_final, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------------
# gated_rms_norm


@pytest.mark.parametrize("group_size", [12, 4, 1])
@pytest.mark.parametrize("gated", [True, False])
def test_gated_rms_norm_matches_the_per_group_formula(group_size, gated):
    generator = _generator()
    x, gate = torch.randn(2, 5, 12, generator=generator, dtype=F64)
    weight = torch.randn(12, generator=generator, dtype=F64)
    gate = gate if gated else None
    y = gated_rms_norm(x, gate, weight, epsilon=1e-3, group_size=group_size)
    torch.testing.assert_close(y, reference_norm(x, gate, weight, epsilon=1e-3, group_size=group_size))


@pytest.mark.parametrize("group_size", [12, 4])
def test_gated_rms_norm_before_the_gate_matches_the_formula(group_size):
    # norm_before_gate: RMSNorm(x) · weight, then · silu(gate) (mamba_ssm's and Falcon-H1's order).
    generator = _generator()
    x, gate = torch.randn(2, 5, 12, generator=generator, dtype=F64)
    weight = torch.randn(12, generator=generator, dtype=F64)
    y = gated_rms_norm(x, gate, weight, epsilon=1e-3, group_size=group_size, norm_before_gate=True)
    expected = reference_norm(x, None, weight, epsilon=1e-3, group_size=group_size) * F.silu(gate)
    torch.testing.assert_close(y, expected)
    assert torch.autograd.gradcheck(
        lambda x, gate, weight: gated_rms_norm(x, gate, weight, epsilon=1e-5, group_size=3, norm_before_gate=True),
        (
            x[:3, :6].clone().requires_grad_(),
            gate[:3, :6].clone().requires_grad_(),
            weight[:6].clone().requires_grad_(),
        ),
    )


def test_gated_rms_norm_epsilon_and_dtype():
    generator = _generator()
    x, gate = torch.randn(2, 5, 8, generator=generator, dtype=F64) * 0.1
    weight = torch.ones(8, dtype=F64)
    small = gated_rms_norm(x, gate, weight, epsilon=1e-6, group_size=4)
    large = gated_rms_norm(x, gate, weight, epsilon=1.0, group_size=4)
    assert not torch.allclose(small, large)
    half = gated_rms_norm(x.bfloat16(), gate.bfloat16(), weight.float(), epsilon=1e-6, group_size=4)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.to(F64), small, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("gated", [True, False])
def test_gated_rms_norm_gradients(gated):
    generator = _generator()
    x, gate = torch.randn(2, 3, 6, generator=generator, dtype=F64).requires_grad_()
    weight = torch.randn(6, generator=generator, dtype=F64).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x, gate, weight: gated_rms_norm(x, gate if gated else None, weight, epsilon=1e-5, group_size=3),
        (x, gate, weight),
    )


# ---------------------------------------------------------------------------------------------------------------------
# Bad inputs


def test_bad_inputs_are_named():
    batch = Batch(LENGTHS)
    x, dt, A, B, C = ssd_inputs(LENGTHS, heads=4, groups=2)
    with pytest.raises(ValueError, match=r"groups of B and C \(3\) must divide the heads \(4\)"):
        ssd_scan(x, dt, A, B[:, :1].expand(-1, 3, -1), C[:, :1].expand(-1, 3, -1), batch, chunk_size=4)
    with pytest.raises(ValueError, match=r"ssd_scan: dt must be \[tokens, heads\]"):
        ssd_scan(x, dt[:, :2], A, B, C, batch, chunk_size=4)
    with pytest.raises(ValueError, match=r"ssd_scan: x must be \[tokens=27"):
        ssd_scan(x[:-1], dt, A, B, C, batch, chunk_size=4)
    with pytest.raises(ValueError, match=r"ssd_scan: state must be \[sequences, heads, head_size, state_size\]"):
        ssd_scan(x, dt, A, B, C, batch, chunk_size=4, state=torch.zeros(4, 4, 3, 4))
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        ssd_scan(x, dt, A, B, C, batch, chunk_size=0)
    u, delta, A1, B1, C1 = selective_inputs(LENGTHS, channels=6, groups=2)
    with pytest.raises(ValueError, match=r"selective_scan: the groups of B and C \(4\) must divide the channels \(6\)"):
        selective_scan(u, delta, A1, B1.repeat(1, 2, 1), C1.repeat(1, 2, 1), batch)
    with pytest.raises(ValueError, match=r"selective_scan: A must be \[channels=6, state_size\]"):
        selective_scan(u, delta, A1[:3], B1, C1, batch)
    xc, weight, bias = conv_inputs(LENGTHS)
    with pytest.raises(ValueError, match="causal_conv1d: activation must be one of"):
        causal_conv1d(xc, weight, bias, batch, activation="relu")
    with pytest.raises(ValueError, match=r"causal_conv1d: weight must be \[channels=5, kernel_size\]"):
        causal_conv1d(xc, weight.T, bias, batch)
    with pytest.raises(ValueError, match=r"causal_conv1d: state must be \[sequences, channels, kernel_size - 1\]"):
        causal_conv1d(xc, weight, bias, batch, state=torch.zeros(4, 5, 4))
    with pytest.raises(ValueError, match=r"gated_rms_norm: group_size \(5\) must divide the channels \(12\)"):
        gated_rms_norm(torch.ones(3, 12), None, torch.ones(12), epsilon=1e-5, group_size=5)
    with pytest.raises(ValueError, match=r"gated_rms_norm: weight must have shape \(12,\)"):
        gated_rms_norm(torch.ones(3, 12), None, torch.ones(6), epsilon=1e-5, group_size=6)


# ---------------------------------------------------------------------------------------------------------------------
# Initializations


def test_dt_bias_is_the_inverse_softplus_of_a_log_uniform_time_step():
    config = DtBiasInitializationConfig(min=1e-3, max=0.1, floor=1e-4)
    bias = torch.empty(20_000)
    initialize_dt_bias(bias, config, _generator())
    again = torch.empty(20_000)
    initialize_dt_bias(again, config, _generator())
    torch.testing.assert_close(bias, again, rtol=0, atol=0)
    dt = F.softplus(bias.double())
    assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5)
    # log dt is uniform on [log min, log max]: its quantiles are evenly spaced.
    quantiles = torch.quantile(dt.log(), torch.linspace(0.05, 0.95, 10, dtype=F64))
    expected = math.log(1e-3) + torch.linspace(0.05, 0.95, 10, dtype=F64) * (math.log(0.1) - math.log(1e-3))
    torch.testing.assert_close(quantiles, expected, rtol=0, atol=0.05)


def test_dt_bias_floor_clamps_small_time_steps():
    bias = torch.empty(10_000)
    initialize_dt_bias(bias, DtBiasInitializationConfig(min=1e-4, max=1e-2, floor=1e-3), _generator())
    dt = F.softplus(bias.double())
    assert dt.min().item() == pytest.approx(1e-3, rel=1e-5)
    clamped = (dt - 1e-3).abs() < 1e-8
    assert clamped.double().mean().item() == pytest.approx(0.5, abs=0.03)  # log-uniform: half below log-midpoint


def test_a_log_range_is_the_log_of_a_uniform_value():
    a_log = torch.empty(20_000)
    initialize_a_log_range(a_log, ALogRangeInitializationConfig(low=2.0, high=10.0), _generator())
    values = a_log.double().exp()
    assert values.min() >= 2.0 - 1e-5 and values.max() <= 10.0 + 1e-5
    quantiles = torch.quantile(values, torch.linspace(0.05, 0.95, 10, dtype=F64))
    torch.testing.assert_close(quantiles, 2.0 + 8.0 * torch.linspace(0.05, 0.95, 10, dtype=F64), rtol=0, atol=0.2)


def test_a_log_state_counts_along_the_last_dimension():
    a_log = torch.empty(3, 5)
    initialize_a_log_state(a_log, ALogStateInitializationConfig(), _generator())
    torch.testing.assert_close(a_log, torch.log(torch.arange(1.0, 6.0)).expand(3, 5))


def test_initializations_are_registered_and_validated(ssm_registry):
    registry = get_registry()
    for config, function in [
        (DtBiasInitializationConfig(), initialize_dt_bias),
        (ALogRangeInitializationConfig(), initialize_a_log_range),
        (ALogStateInitializationConfig(), initialize_a_log_state),
    ]:
        assert registry.implementation_of(config) is function
    config = structure({"type": "dt_bias", "min": 0.01, "max": 0.5, "floor": 0.001}, InitializationConfig)
    assert config == DtBiasInitializationConfig(min=0.01, max=0.5, floor=0.001)
    assert structure({"type": "a_log_range", "high": 8}, InitializationConfig).high == 8.0
    with pytest.raises(ConfigError, match=r"max: must be >= min \(0.5\), got 0.1"):
        structure({"type": "dt_bias", "min": 0.5, "max": 0.1}, InitializationConfig)
    with pytest.raises(ConfigError, match="floor: must be > 0"):
        structure({"type": "dt_bias", "floor": 0.0}, InitializationConfig)
    with pytest.raises(ConfigError, match=r"high: must be >= low \(4.0\), got 2.0"):
        structure({"type": "a_log_range", "low": 4.0, "high": 2.0}, InitializationConfig)


def test_parameter_factory_uses_the_ssm_initializations(ssm_registry):
    distributed = Distributed(DistributedConfig(seed=5, backend="gloo"), world_size=1, rank=0, local_rank=0)
    settings = ResolvedParameter(initialization=ALogStateInitializationConfig(), lr_scale=1.0, weight_decay=False)
    a_log = create_parameter("mixer.a_log", (TensorDim("inner", 4), TensorDim("state", 3)), settings, distributed)
    torch.testing.assert_close(a_log.detach(), torch.log(torch.arange(1.0, 4.0)).expand(4, 3))
    settings = ResolvedParameter(initialization=DtBiasInitializationConfig(), lr_scale=1.0, weight_decay=False)
    dt_bias = create_parameter("mixer.dt_bias", (TensorDim("heads", 64),), settings, distributed)
    assert F.softplus(dt_bias.detach()).min() >= 1e-3 - 1e-7 and F.softplus(dt_bias.detach()).max() <= 0.1 + 1e-7


def test_a_config_naming_them_without_blockzoo_ssm_says_what_to_install(core_only_registry):
    with pytest.raises(
        ConfigError, match=r"unknown initialization type 'dt_bias' .*plugin 'ssm' \(blockzoo-ssm .*\) is disabled"
    ):
        structure({"type": "dt_bias"}, InitializationConfig)
    del get_registry().plugins["ssm"]  # as where blockzoo-ssm is not installed: no entry point, no record
    with pytest.raises(
        ConfigError, match=r"initialization type 'dt_bias' is provided by blockzoo-ssm, which is not installed"
    ):
        structure({"type": "dt_bias"}, InitializationConfig)


def test_config_module_and_package_import_no_torch():
    code = (
        "import sys, blockzoo_ssm, blockzoo_ssm.config, blockzoo_ssm.plugin, blockzoo.builtin;"
        " assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


# ---------------------------------------------------------------------------------------------------------------------
# The mamba_ssm adapter and the autotuning bounds


@pytest.fixture
def clean_modules():
    """Forget the adapter's answer and any (fake) mamba_ssm modules, before and after the test."""

    def forget():
        kernels.mamba_ssm_available.cache_clear()
        for name in [n for n in sys.modules if n.split(".")[0] in ("mamba_ssm", kernels.STAND_IN)]:
            del sys.modules[name]

    forget()
    yield
    forget()


def _fake_package(root, *, init: str, extension: str | None = None):
    (root / "mamba_ssm").mkdir()
    (root / "mamba_ssm" / "__init__.py").write_text(textwrap.dedent(init))
    if extension is not None:
        (root / f"{kernels.STAND_IN}.py").write_text(textwrap.dedent(extension))


def test_mamba_ssm_is_absent_here_and_nothing_is_left_behind(clean_modules):
    assert not mamba_ssm_available()
    with pytest.raises(ImportError, match="mamba_ssm is not installed"):
        import_mamba_ssm()
    assert "mamba_ssm" not in sys.modules and kernels.STAND_IN not in sys.modules


def test_stand_in_only_while_a_triton_only_mamba_ssm_imports(clean_modules, tmp_path, monkeypatch):
    _fake_package(tmp_path, init="import selective_scan_cuda\nscan = selective_scan_cuda\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = import_mamba_ssm()
    assert mamba_ssm_available()
    assert module.scan.__name__ == kernels.STAND_IN and kernels.STAND_IN not in sys.modules
    with pytest.raises(AttributeError, match="compiled Mamba 1 scan is not installed"):
        module.scan.fwd  # noqa: B018


def test_a_real_extension_is_never_hidden(clean_modules, tmp_path, monkeypatch):
    _fake_package(tmp_path, init="import selective_scan_cuda\nscan = selective_scan_cuda\n", extension="REAL = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_mamba_ssm().scan.REAL == 1


def test_a_broken_extension_is_reported_not_hidden(clean_modules, tmp_path, monkeypatch):
    _fake_package(tmp_path, init="import selective_scan_cuda\n", extension="import libcudart_missing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="libcudart_missing"):
        import_mamba_ssm()
    with pytest.warns(UserWarning, match="mamba_ssm is installed but does not import .*libcudart_missing"):
        assert not mamba_ssm_available()


def test_a_mamba_ssm_that_fails_to_import_leaves_no_stand_in(clean_modules, tmp_path, monkeypatch):
    _fake_package(tmp_path, init="import selective_scan_cuda\nimport tilelang_missing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning, match="tilelang_missing"):
        assert not mamba_ssm_available()
    assert kernels.STAND_IN not in sys.modules and "mamba_ssm" not in sys.modules


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("scale_input", [True, False])
def test_the_kernel_call_gives_mamba_chunk_scan_combined_what_it_expects(monkeypatch, scale_input, skip):
    # The GPU kernel itself is tested in test_ssm_gpu.py; here a stand-in with its contract checks the call.
    def combined(x, dt, A, B, C, chunk_size, D, seq_idx, dt_bias, dt_softplus, dt_limit):
        assert x.shape[0] == dt.shape[0] == B.shape[0] == C.shape[0] == seq_idx.shape[0] == 1  # one packed sequence
        assert A.dtype == torch.float32 and seq_idx.dtype == torch.int32 and chunk_size == 4
        assert dt_bias is None and not dt_softplus and dt_limit == (0.0, math.inf)
        lengths = torch.unique_consecutive(seq_idx[0], return_counts=True)[1].tolist()
        y, _ = reference_ssd(x[0], dt[0], A, B[0], C[0], lengths, scale_input=True)  # it always scales by dt
        if D is not None:
            y = y + D[:, None] * x[0]  # y += D·x, x being what it is given
        return y[None].to(x.dtype)

    monkeypatch.setattr(kernels, "_chunk_scan_combined", lambda: combined)
    x, dt, A, B, C = ssd_inputs(LENGTHS, dtype=torch.float32)
    D = torch.randn(x.shape[1], generator=torch.Generator().manual_seed(9)) if skip else None
    document_index = Batch(LENGTHS).document_index
    y = kernels.mamba_chunk_scan(x, dt, A, B, C, document_index, chunk_size=4, D=D, scale_input=scale_input)
    expected, _ = reference_ssd(x, dt, A, B, C, LENGTHS, scale_input=scale_input)
    if skip:
        expected = expected + D.double()[:, None] * x.double()
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)


def _kernel_stand_in(x, dt, A, B, C, chunk_size, D, seq_idx, dt_bias, dt_softplus, dt_limit):
    """mamba_chunk_scan_combined's contract for the time step, written from its documentation:
    dt' = clamp(softplus(dt + dt_bias)) in fp32, then the scan of x scaled by dt' (float64 reference here)."""
    lengths = torch.unique_consecutive(seq_idx[0], return_counts=True)[1].tolist()
    step = dt[0].double() + (0 if dt_bias is None else dt_bias.double())
    step = F.softplus(step) if dt_softplus else step
    step = step.clamp(*dt_limit)
    y, _ = reference_ssd(x[0], step, A, B[0], C[0], lengths, scale_input=True)
    return y[None].to(x.dtype)


@pytest.mark.parametrize("scale_input", [True, False])
def test_ssd_scan_time_step_from_dt_bias_softplus_and_limit(monkeypatch, scale_input):
    """The torch path and the kernel call (a stand-in honouring the kernel's contract) against the float64 loop on
    clamp(softplus(dt + dt_bias)): the kernel path hands dt, dt_bias, softplus and the limit to the kernel."""
    x, dt, A, B, C = ssd_inputs(LENGTHS, dtype=torch.float32)
    raw = dt * 4 - 2  # raw in_proj outputs, either sign
    dt_bias = torch.linspace(-1.0, 1.0, x.shape[1])
    limit = (0.3, 1.2)  # clamps some steps on both sides
    expected_step = F.softplus(raw.double() + dt_bias.double()).clamp(*limit)
    assert (expected_step == limit[0]).any() and (expected_step == limit[1]).any()
    expected, _ = reference_ssd(x, expected_step, A, B, C, LENGTHS, scale_input=scale_input)

    def scan(batch):
        return ssd_scan(
            x, raw, A, B, C, batch, chunk_size=4, scale_input=scale_input, dt_bias=dt_bias, dt_softplus=True,
            dt_limit=limit,
        )  # fmt: skip

    torch.testing.assert_close(scan(Batch(LENGTHS)).double(), expected, rtol=1e-5, atol=1e-5)

    calls = []

    def stand_in(*args, **kwargs):
        calls.append(kwargs)
        return _kernel_stand_in(*args, **kwargs)

    class FakeCuda(torch.Tensor):  # the dispatch, not a GPU, is under test
        @property
        def is_cuda(self):
            return True

    monkeypatch.setattr(kernels, "_chunk_scan_combined", lambda: stand_in)
    monkeypatch.setattr(scan_module, "mamba_ssm_available", lambda: True)
    x = x.as_subclass(FakeCuda)
    y = scan(Batch(LENGTHS))
    torch.testing.assert_close(y.as_subclass(torch.Tensor).double(), expected, rtol=1e-5, atol=1e-5)
    # With scale_input the kernel computes the time step; without, it is given x / dt' and dt' itself.
    assert (calls[0]["dt_bias"] is dt_bias) == scale_input and calls[0]["dt_softplus"] == scale_input


def test_time_step_without_processing_is_dt_itself():
    dt = torch.rand(5, 3)
    assert scan_module.time_step(dt) is dt
    torch.testing.assert_close(scan_module.time_step(dt, softplus=True), F.softplus(dt))


def test_autotune_limit_from_the_environment():
    assert kernels.autotune_limit({}) == kernels.SMALL_AUTOTUNE == 2
    assert kernels.autotune_limit({"BLOCKZOO_SSD_AUTOTUNE": "small"}) == 2
    assert kernels.autotune_limit({"BLOCKZOO_SSD_AUTOTUNE": "FULL"}) is None
    assert kernels.autotune_limit({"BLOCKZOO_SSD_AUTOTUNE": "1"}) == 1
    for bad in ("0", "fast", "-2"):
        with pytest.raises(ValueError, match="BLOCKZOO_SSD_AUTOTUNE"):
            kernels.autotune_limit({"BLOCKZOO_SSD_AUTOTUNE": bad})


def test_middle_configs_keep_the_configs_of_middle_tile_cost():
    def config(m, n, stages):
        return SimpleNamespace(kwargs={"BLOCK_SIZE_M": m, "BLOCK_SIZE_N": n}, num_stages=stages)

    configs = [config(128, 256, 3), config(32, 32, 4), config(64, 64, 4), config(64, 128, 4), config(16, 16, 2)]
    # Tile costs (block sizes x stages): 98304, 4096, 16384, 32768, 512.
    assert kernels.middle_configs(configs, 1) == [configs[2]]
    assert kernels.middle_configs(configs, 2) == [configs[1], configs[2]]
    assert kernels.middle_configs(configs, 3) == [configs[1], configs[2], configs[3]]
    assert kernels.middle_configs(configs, 9) == [configs[4], configs[1], configs[2], configs[3], configs[0]]


def test_restrict_autotuning_trims_every_autotuned_kernel(monkeypatch):
    # Stand-ins with Triton's structure, whether triton is installed or not (an Autotuner keeps its configs in
    # `configs`; wrappers such as heuristics keep the wrapped kernel in `fn`). The real kernels: test_ssm_gpu.py.
    class KernelInterface:
        def __init__(self, fn):
            self.fn = fn

    class Autotuner(KernelInterface):
        def __init__(self, fn, configs):
            super().__init__(fn)
            self.configs = configs

    for name, attributes in [
        ("triton", {}),
        ("triton.runtime", {}),
        ("triton.runtime.jit", {"KernelInterface": KernelInterface}),
        ("triton.runtime.autotuner", {"Autotuner": Autotuner}),
    ]:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        for key, value in attributes.items():
            setattr(sys.modules[name], key, value)
    configs = [SimpleNamespace(kwargs={"BLOCK_SIZE_M": 2**i}, num_stages=1) for i in range(7)]
    module = types.ModuleType("ssd_fake")
    module.plain = Autotuner(KernelInterface(lambda: None), list(configs))
    module.wrapped = KernelInterface(Autotuner(KernelInterface(lambda: None), list(configs)))
    module.short = Autotuner(KernelInterface(lambda: None), configs[:1])
    module.other = KernelInterface(lambda: None)
    kernels.restrict_autotuning([module], 2)
    assert module.plain.configs == module.wrapped.fn.configs == configs[2:4]
    assert module.short.configs == configs[:1]
    # A triton whose Autotuner cannot cache on disk (before 3.4) is left as it is.
    assert kernels.cache_autotuning([module]) == 0 and not hasattr(module.plain, "cache_results")


def _empty_kernel(x_pointer):  # the body of the real-triton autotuning tests' kernels (never launched)
    pass


def test_cache_autotuning_switches_every_autotuner_on(monkeypatch):
    triton = pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    configs = [triton.Config({"BLOCK": block}) for block in (16, 32)]

    def autotuned(**options):
        return triton.autotune(configs=configs, key=[], **options)(triton.jit(_empty_kernel))

    module = types.ModuleType("ssd_fake")
    module.plain, module.cached = autotuned(), autotuned(cache_results=True)
    module.wrapped = triton.heuristics({"EXTRA": lambda arguments: 1})(autotuned())
    module.unrelated = triton.jit(_empty_kernel)
    module.alias = module.plain
    assert not module.plain.cache_results and not module.wrapped.fn.cache_results
    assert len(kernels.autotuners([module])) == 3
    assert kernels.cache_autotuning([module]) == 2
    assert module.plain.cache_results and module.wrapped.fn.cache_results and module.cached.cache_results


def test_the_convolution_kernels_cache_their_autotuning():
    pytest.importorskip("triton")
    from blockzoo_ssm import triton_conv

    assert kernels.autotuners([triton_conv]) == [triton_conv._forward_autotuned, triton_conv._backward_autotuned]
    assert all(kernel.cache_results for kernel in kernels.autotuners([triton_conv]))
