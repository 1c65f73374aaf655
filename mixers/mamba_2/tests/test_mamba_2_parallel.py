"""Tensor-parallel and sequence-tensor-parallel Mamba 2 equal the single-process run (outputs and gradients), and so
does tensor-parallel decoding. One set of two gloo processes runs every case; each rank builds the single-process
reference itself from the same seed."""

import pytest
import torch
from mamba_2_reference import AROUND_ONE, RANDOM, SEED, build, inputs, single_process

from blockzoo.api import Distributed, DistributedConfig
from blockzoo.layers.base import Batch
from blockzoo.testing.distributed import run_distributed

TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}
LENGTHS = [5, 3, 4]  # 12 tokens: sequence-tensor-parallel splits them between the 2 ranks.
LARGE_DT = {"dt_bias": {"initialization": {"type": "normal", "std": 1.0}}}
CASES = {
    "one-group-per-rank": {
        "heads": 4,
        "head_size": 4,
        "groups": 2,
        "state_size": 3,
        "chunk_size": 4,
        **LARGE_DT,
        "convolution": {"kernel_size": 3, "bias": RANDOM},
        "normalization": {"weight": AROUND_ONE},
        "d": AROUND_ONE,
    },
    "two-groups-per-rank-biases-d-per-channel": {
        "heads": 8,
        "head_size": 2,
        "groups": 4,
        "state_size": 2,
        "chunk_size": 3,
        **LARGE_DT,
        "add_linear_biases": True,
        "z": {"bias": RANDOM},
        "b": {"bias": RANDOM},
        "dt": {"bias": RANDOM},
        "out_proj": {"bias": RANDOM},
        "d_per_channel": True,
        "d": RANDOM,
        "dt_limit": [0.1, 2.0],
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
        torch.testing.assert_close(meta.local_to_global(parameter.detach(), group), reference_parameter.detach())
        gradient = meta.local_to_global(parameter.grad, group)
        torch.testing.assert_close(gradient, reference_parameter.grad, **TOLERANCE, msg=f"{label}: gradient of {name}")


def _check_decoding_matches(distributed: Distributed, data: dict, label: str) -> None:
    """Prefill then one token at a time, tensor-parallel, against the single-process full forward."""
    full_lengths = [5, 4]
    hidden, _ = inputs(sum(full_lengths))
    with torch.no_grad():
        expected = build(data, single_process())(hidden, Batch(full_lengths)).split(full_lengths)
    layer = build(data, distributed)
    state = layer.new_state(2, 8, distributed.device, torch.float32)
    sequences, past, outputs = hidden.split(full_lengths), [0, 0], [[], []]
    with torch.no_grad():
        for lengths in [[3, 2], [1, 1], [1, 1]]:
            chunk = torch.cat([sequence[p : p + n] for sequence, p, n in zip(sequences, past, lengths)])
            for index, part in enumerate(layer(chunk, Batch(lengths, past_lengths=past), state).split(lengths)):
                outputs[index].append(part)
            past = [p + n for p, n in zip(past, lengths)]
    for index in range(2):
        torch.testing.assert_close(torch.cat(outputs[index]), expected[index][: past[index]], **TOLERANCE, msg=label)


def _parallel_cases() -> None:
    def layout(**parallel) -> Distributed:
        # The first one starts the process group; the later one lays out its ranks differently.
        return Distributed(DistributedConfig(seed=SEED, backend="gloo", timeout=60, **parallel))

    with layout(tensor_parallel=2) as distributed:
        sequence_parallel = layout(tensor_parallel=2, sequence_tensor_parallel=True)
        for name, data in CASES.items():
            _check_matches(distributed, data, f"TP=2 {name}")
            _check_matches(sequence_parallel, data, f"TP=2 with sequence-tensor-parallel {name}")
        for name, data in CASES.items():
            _check_decoding_matches(distributed, data, f"TP=2 decoding {name}")
        with pytest.raises(ValueError, match=r"mamba_2 mixer 'mixer': groups: tensor_parallel=2 must divide groups"):
            build({"heads": 4, "head_size": 4, "groups": 1}, distributed)


@pytest.mark.distributed
def test_tensor_parallel_matches_single_process():
    run_distributed(2, _parallel_cases)
