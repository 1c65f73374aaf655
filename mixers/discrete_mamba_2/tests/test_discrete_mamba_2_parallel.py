"""Tensor-parallel and sequence-tensor-parallel discrete Mamba 2 equal the single-process run (outputs, the input
gradient and every parameter's gradient assembled to its global tensor), and so does tensor-parallel decoding.

One set of two gloo processes runs every case; each rank builds the single-process reference itself from the same
seed. Cases: several groups per rank and several heads per group, with z_bias (no in_proj bias) or with biases.
"""

import pytest
import torch
from dm2_reference import RANDOM, RANDOM_BIAS, SEED, build, inputs, single_process

from blockzoo.api import Distributed, DistributedConfig
from blockzoo.layers.base import Batch
from blockzoo.testing.distributed import run_distributed

TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}
LENGTHS = [5, 3, 6]  # 14 tokens: sequence-tensor-parallel gives each of the 2 ranks 7.
CASES = {
    "z-bias-silu": {
        "heads": 8,
        "groups": 4,
        "head_size": 3,
        "state_size": 4,
        "chunk_size": 4,
        "activation": "silu",
        "z_bias": RANDOM,
        "d": RANDOM,
    },
    "biases-kernel-3": {
        "heads": 4,
        "groups": 2,
        "head_size": 4,
        "state_size": 3,
        "chunk_size": 3,
        "convolution": {"kernel_size": 3, "bias": RANDOM},
        "add_linear_biases": True,
        **{name: RANDOM_BIAS for name in ("x", "b", "c", "z", "dt", "out_proj")},
    },
}


def _check_matches(distributed: Distributed, data: dict, label: str) -> None:
    hidden, loss_weights = inputs(sum(LENGTHS))
    reference = build(data, single_process())
    reference_input = hidden.clone().requires_grad_()
    reference_output = reference(reference_input, Batch(LENGTHS))
    (reference_output * loss_weights).sum().backward()

    layer = build(data, distributed)
    group, rank, size = distributed.tensor_group, distributed.tensor_rank, distributed.tensor_size
    own = (lambda tensor: tensor.chunk(size)[rank]) if distributed.sequence_tensor_parallel else (lambda tensor: tensor)
    local_input = own(hidden).clone().requires_grad_()
    output = layer(local_input, Batch(LENGTHS))
    (output * own(loss_weights)).sum().backward()
    distributed.reduce_replicated_gradients(layer.parameters())

    torch.testing.assert_close(output, own(reference_output), **TOLERANCE, msg=f"{label}: output")
    torch.testing.assert_close(local_input.grad, own(reference_input.grad), **TOLERANCE, msg=f"{label}: input grad")
    for (name, parameter), reference_parameter in zip(layer.named_parameters(), reference.parameters(), strict=True):
        meta = parameter.meta
        assert parameter.shape != reference_parameter.shape or name.endswith("out_proj.bias"), name
        torch.testing.assert_close(meta.local_to_global(parameter.detach(), group), reference_parameter.detach())
        gradient = meta.local_to_global(parameter.grad, group)
        torch.testing.assert_close(gradient, reference_parameter.grad, **TOLERANCE, msg=f"{label}: gradient of {name}")


def _check_decoding_matches(distributed: Distributed, data: dict, label: str) -> None:
    """Prefill, then one token at a time, tensor-parallel, against the single-process full forward."""
    full_lengths = [6, 4]
    hidden, _ = inputs(sum(full_lengths))
    with torch.no_grad():
        expected = build(data, single_process())(hidden, Batch(full_lengths)).split(full_lengths)
    layer = build(data, distributed)
    state = layer.new_state(2, 8, distributed.device, torch.float32)
    sequences, past, outputs = hidden.split(full_lengths), [0, 0], [[], []]
    with torch.no_grad():
        for lengths in [[4, 2], [1, 1], [1, 1]]:
            chunk = torch.cat([sequence[p : p + n] for sequence, p, n in zip(sequences, past, lengths)])
            for index, part in enumerate(layer(chunk, Batch(lengths, past_lengths=past), state).split(lengths)):
                outputs[index].append(part)
            past = [p + n for p, n in zip(past, lengths)]
    for index in range(2):
        torch.testing.assert_close(torch.cat(outputs[index]), expected[index][: past[index]], **TOLERANCE, msg=label)


def _parallel_cases() -> None:
    def layout(**parallel) -> Distributed:
        # The first one starts the process group; the later ones lay out its ranks differently.
        return Distributed(DistributedConfig(seed=SEED, backend="gloo", timeout=60, **parallel))

    with layout(tensor_parallel=2) as distributed:
        sequence_parallel = layout(tensor_parallel=2, sequence_tensor_parallel=True)
        for name, data in CASES.items():
            _check_matches(distributed, data, f"TP=2 {name}")
            _check_matches(sequence_parallel, data, f"TP=2 with sequence-tensor-parallel {name}")
            _check_decoding_matches(distributed, data, f"TP=2 decoding {name}")
        with pytest.raises(ValueError, match=r"tensor_parallel=2 must divide groups \(1\)"):
            build({"heads": 4, "groups": 1, "head_size": 2}, distributed)


@pytest.mark.distributed
def test_tensor_parallel_matches_single_process():
    run_distributed(2, _parallel_cases)
