"""The mixer on CUDA (where blockzoo.ssm takes mamba_ssm's Triton SSD kernel when it is importable) against the same
mixer on the CPU path: outputs and gradients over packed documents, fp32 and bf16, and decoding on CUDA against the
full forward. Run on a GPU machine (skipped without CUDA).

Tolerances are relative errors ‖x − reference‖ / ‖reference‖: fp32 2e-3 (the Triton kernels may use TF32), bf16
3e-2 for outputs and 5e-2 for gradients (8 bits of mantissa, errors adding up over the projections and the scan).
"""

import pytest
import torch
from dm2_reference import SEED, build, inputs

from blockzoo.api import Distributed, DistributedConfig
from blockzoo.layers.base import Batch

pytestmark = pytest.mark.gpu

HIDDEN = 64
LENGTHS = [37, 1, 90, 128]  # Not multiples of the chunk size.
CASES = {
    "grouped-identity": {"heads": 8, "groups": 2, "head_size": 16, "state_size": 16, "chunk_size": 64},
    "silu-biases": {
        "heads": 4,
        "groups": 4,
        "head_size": 32,
        "state_size": 32,
        "chunk_size": 64,
        "activation": "silu",
        "add_linear_biases": True,
        "convolution": {"kernel_size": 3},
    },
}
OUTPUT_TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 3e-2}
GRADIENT_TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 5e-2}


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
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_matches_the_cpu_path(case, dtype):
    hidden, loss_weights = inputs(sum(LENGTHS), HIDDEN)
    reference = build(CASES[case], hidden=HIDDEN)
    expected, expected_input_grad, expected_grads = _forward_backward(reference, hidden, loss_weights, LENGTHS)

    layer = build(CASES[case], _gpu(), hidden=HIDDEN)
    output, input_grad, grads = _forward_backward(layer, hidden.cuda().to(dtype), loss_weights.cuda(), LENGTHS)
    assert output.dtype == dtype and torch.isfinite(output).all()
    assert _relative_error(output, expected) < OUTPUT_TOLERANCE[dtype]
    assert _relative_error(input_grad, expected_input_grad) < GRADIENT_TOLERANCE[dtype]
    for name, gradient in grads.items():
        assert torch.isfinite(gradient).all(), name
        assert _relative_error(gradient, expected_grads[name]) < GRADIENT_TOLERANCE[dtype], name


def test_cuda_decoding_equals_the_full_forward():
    layer = build(CASES["grouped-identity"], _gpu(), hidden=HIDDEN)
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
