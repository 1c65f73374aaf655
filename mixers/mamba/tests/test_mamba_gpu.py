"""The mixer on CUDA (the selective scan takes blockzoo's Triton kernel there) against the same mixer on the CPU
path: outputs and gradients over packed documents, both layouts, fp32 and bf16; generation on CUDA against the
full forward. Run on a GPU machine (skipped without CUDA).

Tolerances are relative errors ‖x − reference‖ / ‖reference‖: fp32 1e-3 (kernels may use TF32); bf16 3e-2 for
outputs and 5e-2 for gradients (bf16 keeps 8 bits of mantissa; errors add up over the projections and the scan).
"""

import pytest
import torch
from mamba_reference import SEED, build, inputs

from blockzoo.api import Distributed, DistributedConfig
from blockzoo.layers.base import Batch

pytestmark = pytest.mark.gpu

HIDDEN = 64
LENGTHS = [37, 1, 90, 128]  # Not multiples of any block size.
RANDOM_BIAS = {"bias": {"initialization": {"type": "normal", "std": 0.5}}}
CASES = {
    "standard-norms": {
        "state_size": 16,
        "convolution": RANDOM_BIAS,
        "dt_norm": {"type": "rms_norm"},
        "b_norm": {"type": "rms_norm"},
        "c_norm": {"type": "rms_norm"},
    },
    "grouped": {"state_size": 16, "inner_size": 128, "xb_size": 32, "add_linear_biases": True},
    "grouped-repeat-after": {"state_size": 8, "inner_size": 96, "xb_size": 32, "repeat_xb_before_convolution": False},
}
OUTPUT_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 3e-2}
GRADIENT_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2}


def _gpu() -> Distributed:
    return Distributed(DistributedConfig(seed=SEED, backend="nccl"), world_size=1, rank=0, local_rank=0)


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
def test_cuda_matches_the_cpu_path(case, dtype, monkeypatch):
    import blockzoo.ssm.triton_selective_scan as triton_selective_scan  # imports triton: CUDA machines only

    calls = []
    kernel = triton_selective_scan.selective_scan_triton
    monkeypatch.setattr(triton_selective_scan, "selective_scan_triton", lambda *a: calls.append(1) or kernel(*a))
    hidden, loss_weights = inputs(sum(LENGTHS), HIDDEN)
    reference = build(CASES[case], hidden=HIDDEN)
    expected, expected_input_grad, expected_grads = _forward_backward(reference, hidden, loss_weights, LENGTHS)

    layer = build(CASES[case], _gpu(), hidden=HIDDEN)
    output, input_grad, grads = _forward_backward(layer, hidden.cuda().to(dtype), loss_weights.cuda(), LENGTHS)
    assert calls, "the CUDA forward did not take the Triton selective scan"
    assert output.dtype == dtype and torch.isfinite(output).all()
    assert _relative_error(output, expected) < OUTPUT_TOLERANCE[dtype]
    assert _relative_error(input_grad, expected_input_grad) < GRADIENT_TOLERANCE[dtype]
    for name, gradient in grads.items():
        assert torch.isfinite(gradient).all(), name
        assert _relative_error(gradient, expected_grads[name]) < GRADIENT_TOLERANCE[dtype], name


@pytest.mark.parametrize("case", ["standard-norms", "grouped-repeat-after"])
def test_generation_on_cuda_equals_the_full_forward(case):
    layer = build(CASES[case], _gpu(), hidden=HIDDEN)
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
