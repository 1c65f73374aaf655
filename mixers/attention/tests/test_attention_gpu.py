"""GPU kernels against the CPU path (the `torch` kernel in fp32): outputs and gradients over packed documents,
windows, GQA/MQA, and KV-cache decoding. Run on a GPU machine (skipped without CUDA).

Tolerances are relative errors ‖x − reference‖ / ‖reference‖: fp32 1e-3 (kernels may use TF32), bf16 2e-2 for
outputs and 3e-2 for gradients (bf16 keeps 8 bits of mantissa; errors add up over the projections).
A kernel that cannot run here fails with its reason rather than skipping.
"""

import pytest
import torch
from attention_reference import SEED, build, inputs

from blockzoo.api import Distributed, DistributedConfig
from blockzoo.layers.base import Batch
from blockzoo_attention.kernels import KERNELS, select_kernel

pytestmark = pytest.mark.gpu

HIDDEN = 64
LENGTHS = [37, 1, 90, 128]  # Not multiples of any block size.
CASES = {
    "gqa-window-llama3": {
        "heads": 4,
        "head_groups": 2,
        "head_size": 32,
        "window_size": 16,
        "rotary": {"type": "llama3", "theta": 1000.0, "original_context_length": 64},
    },
    "mha-causal-norms": {"heads": 4, "head_size": 32, "query_norm": {"type": "rms_norm"}, "key_norm": {}},
    "mqa-non-causal": {"heads": 4, "head_groups": 1, "head_size": 32, "causal": False, "softmax_scale": 0.3},
}
KERNEL_DTYPES = [("torch", torch.float32), ("torch", torch.bfloat16), ("flex", torch.float32)]
KERNEL_DTYPES += [("flex", torch.bfloat16), ("varlen", torch.bfloat16)]
OUTPUT_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 2e-2}
GRADIENT_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 3e-2}


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
@pytest.mark.parametrize(("implementation", "dtype"), KERNEL_DTYPES, ids=lambda value: str(value))
def test_kernel_matches_the_cpu_path(case, implementation, dtype):
    hidden, loss_weights = inputs(sum(LENGTHS), HIDDEN)
    reference = build(CASES[case], hidden=HIDDEN)
    expected, expected_input_grad, expected_grads = _forward_backward(reference, hidden, loss_weights, LENGTHS)

    layer = build({**CASES[case], "implementation": implementation}, _gpu(), hidden=HIDDEN)
    output, input_grad, grads = _forward_backward(layer, hidden.cuda().to(dtype), loss_weights.cuda(), LENGTHS)
    assert output.dtype == dtype
    assert _relative_error(output, expected) < OUTPUT_TOLERANCE[dtype]
    assert _relative_error(input_grad, expected_input_grad) < GRADIENT_TOLERANCE[dtype]
    for name, gradient in grads.items():
        assert _relative_error(gradient, expected_grads[name]) < GRADIENT_TOLERANCE[dtype], name


@pytest.mark.parametrize(("implementation", "dtype"), [("varlen", torch.bfloat16), ("flex", torch.bfloat16)])
def test_kv_cache_decoding_equals_the_full_forward(implementation, dtype):
    layer = build({**CASES["gqa-window-llama3"], "implementation": implementation}, _gpu(), hidden=HIDDEN)
    full_lengths = [40, 29]
    hidden = inputs(sum(full_lengths), HIDDEN)[0].cuda().to(dtype)
    with torch.no_grad():
        expected = layer(hidden, Batch(full_lengths, device="cuda")).split(full_lengths)
    sequences, past, outputs = hidden.split(full_lengths), [0, 0], [[], []]
    state = layer.new_state(2, 64, torch.device("cuda"), dtype)
    with torch.no_grad():
        for lengths in [[36, 20], [2, 7], [1, 1], [1, 1]]:
            chunk = torch.cat([sequence[p : p + n] for sequence, p, n in zip(sequences, past, lengths)])
            batch = Batch(lengths, past_lengths=past, device="cuda")
            for index, part in enumerate(layer(chunk, batch, state).split(lengths)):
                outputs[index].append(part)
            past = [p + n for p, n in zip(past, lengths)]
    for index in range(2):
        expected_part = expected[index][: past[index]].float().cpu()
        assert _relative_error(torch.cat(outputs[index]), expected_part) < OUTPUT_TOLERANCE[dtype]


def test_auto_picks_the_gpu_kernels():
    bf16 = torch.zeros(4, 2, 64, device="cuda", dtype=torch.bfloat16)
    assert select_kernel("auto", bf16) is KERNELS["varlen"], KERNELS["varlen"].unavailable(bf16)
    assert select_kernel("auto", bf16.float()) is KERNELS["torch"]
