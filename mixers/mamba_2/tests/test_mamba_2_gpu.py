"""The Mamba 2 mixer on CUDA (the SSD scan through mamba_ssm's Triton kernels when installed) against the same mixer
on the CPU path in fp32: outputs and gradients over packed documents, and bf16 within a loose tolerance; decoding
on CUDA (the state path) against the full forward (the kernel path). Run on a GPU machine (skipped without CUDA).

Tolerances are relative errors ‖x − reference‖ / ‖reference‖ (those of core/tests/test_ssm_gpu.py): fp32 5e-3 for
outputs and 1e-2 for gradients (mamba_ssm's kernels multiply fp32 in TF32, about 1e-3 each), bf16 3e-2 and 5e-2
(bf16 keeps 8 bits of mantissa; the scan and projections add errors up).
"""

import pytest
import torch
from mamba_2_reference import AROUND_ONE, RANDOM, SEED, build, inputs

from blockzoo.api import Distributed, DistributedConfig
from blockzoo.layers.base import Batch

pytestmark = pytest.mark.gpu

HIDDEN = 64
LENGTHS = [37, 1, 90, 128]  # Not multiples of the chunk size.
CASES = {
    "groups-per-group-norm": {
        "heads": 8,
        "head_size": 16,
        "groups": 2,
        "state_size": 16,
        "chunk_size": 32,
        "convolution": {"bias": RANDOM},
        "normalization": {"weight": AROUND_ONE},
    },
    "whole-norm-d-per-channel-dt-limit-biases": {
        "heads": 4,
        "head_size": 32,
        "groups": 1,
        "state_size": 32,
        "chunk_size": 64,
        "normalization": {"per_group": False},
        "d_per_channel": True,
        "d": RANDOM,
        "dt_limit": [0.01, 0.5],
        "add_linear_biases": True,
    },
}
OUTPUT_TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 3e-2}
GRADIENT_TOLERANCE = {torch.float32: 1e-2, torch.bfloat16: 5e-2}


def _gpu(**options) -> Distributed:
    return Distributed(DistributedConfig(seed=SEED, backend="nccl", **options), world_size=1, rank=0, local_rank=0)


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    reference = reference.detach().float().cpu()
    return float((value.detach().float().cpu() - reference).norm() / reference.norm())


def _forward_backward(layer, hidden, loss_weights, lengths):
    hidden = hidden.clone().requires_grad_()
    output = layer(hidden, Batch(lengths, device=hidden.device))
    (output.float() * loss_weights).sum().backward()
    return output, hidden.grad, {name: parameter.grad for name, parameter in layer.named_parameters()}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_matches_the_cpu_path(case, dtype):
    hidden, loss_weights = inputs(sum(LENGTHS), HIDDEN)
    reference = build(CASES[case], hidden=HIDDEN)
    expected, expected_input_grad, expected_grads = _forward_backward(reference, hidden, loss_weights, LENGTHS)

    layer = build(CASES[case], _gpu(), hidden=HIDDEN)
    output, input_grad, grads = _forward_backward(layer, hidden.cuda().to(dtype), loss_weights.cuda(), LENGTHS)
    assert output.dtype == dtype and bool(torch.isfinite(output).all())
    assert _relative_error(output, expected) < OUTPUT_TOLERANCE[dtype]
    assert _relative_error(input_grad, expected_input_grad) < GRADIENT_TOLERANCE[dtype]
    for name, gradient in grads.items():
        assert bool(torch.isfinite(gradient).all()), name
        assert _relative_error(gradient, expected_grads[name]) < GRADIENT_TOLERANCE[dtype], name


def test_cuda_decoding_equals_the_full_forward():
    layer = build(CASES["groups-per-group-norm"], _gpu(), hidden=HIDDEN)
    full_lengths = [40, 29]
    hidden = inputs(sum(full_lengths), HIDDEN)[0].cuda()
    with torch.no_grad():
        expected = layer(hidden, Batch(full_lengths, device="cuda")).split(full_lengths)
    sequences, past, outputs = hidden.split(full_lengths), [0, 0], [[], []]
    state = layer.new_state(2, 64, torch.device("cuda"), torch.float32)
    with torch.no_grad():
        for lengths in [[36, 20], [2, 7], [1, 1], [1, 1]]:
            chunk = torch.cat([sequence[p : p + n] for sequence, p, n in zip(sequences, past, lengths)])
            batch = Batch(lengths, past_lengths=past, device="cuda")
            for index, part in enumerate(layer(chunk, batch, state).split(lengths)):
                outputs[index].append(part)
            past = [p + n for p, n in zip(past, lengths)]
    for index in range(2):
        expected_part = expected[index][: past[index]]
        assert _relative_error(torch.cat(outputs[index]), expected_part) < OUTPUT_TOLERANCE[torch.float32]


def test_the_kernels_are_installed():
    """On CUDA the scan should take mamba_ssm's Triton kernels: the plugin's environment check says if not."""
    from blockzoo_mamba_2.plugin import check_environment

    assert check_environment() == []
