"""Tensor-parallel and sequence-tensor-parallel Mamba equal the single-process run (outputs and all gradients),
and so does tensor-parallel generation.

One set of 2 gloo processes runs every case; each rank builds the single-process reference itself from the same
seed. Cases cover both layouts: the standard one's row-parallel x_proj (with a bias) and its dt/B/C norms on the
residual-stream layout; the grouped one's heads split with the x/B heads they read, its B/C norms inside the tensor
region (partial gradients), the convolution before and after the head repetition.
"""

import pytest
import torch
from mamba_reference import SEED, build, inputs, single_process

from blockzoo.api import Distributed, DistributedConfig
from blockzoo.layers.base import Batch
from blockzoo.testing.distributed import run_distributed

TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}
LENGTHS = [5, 3, 4]  # 12 tokens: sequence-tensor-parallel splits them between the 2 ranks.
RANDOM_BIAS = {"bias": {"initialization": {"type": "normal", "std": 0.5}}}
RANDOM_NORM = {"type": "rms_norm", "weight": {"initialization": {"type": "normal", "mean": 1.0, "std": 0.3}}}
NORMS = {"dt_norm": RANDOM_NORM, "b_norm": RANDOM_NORM, "c_norm": RANDOM_NORM}
CASES = {
    "standard-biases-norms": {
        "state_size": 4,
        "inner_size": 24,
        "dt_rank": 3,
        "add_linear_biases": True,
        "x": RANDOM_BIAS,
        "out_proj": RANDOM_BIAS,
        "x_proj": {"bias": {"enabled": True, "initialization": {"type": "normal", "std": 0.5}}},
        "convolution": {"kernel_size": 3, **RANDOM_BIAS},
        **NORMS,
    },
    "grouped-repeat-before-norms": {
        "state_size": 4,
        "inner_size": 32,
        "xb_size": 16,
        "dt_rank": 2,
        "add_linear_biases": True,
        "b": RANDOM_BIAS,
        "dt_in_proj": RANDOM_BIAS,
        "out_proj": RANDOM_BIAS,
        **NORMS,
    },
    "grouped-repeat-after": {
        "state_size": 4,
        "inner_size": 48,
        "xb_size": 8,
        "repeat_xb_before_convolution": False,
        "convolution": RANDOM_BIAS,
        "b_norm": RANDOM_NORM,
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
        _check_decoding_matches(distributed, CASES["standard-biases-norms"], "TP=2 decoding, standard")
        _check_decoding_matches(distributed, CASES["grouped-repeat-after"], "TP=2 decoding, grouped")
        with pytest.raises(ValueError, match=r"mamba 'mixer': xb_size: tensor_parallel=2 must divide the x/B heads"):
            build({"state_size": 4, "xb_size": 4, "expand": 1}, distributed)


@pytest.mark.distributed
def test_tensor_parallel_matches_single_process():
    run_distributed(2, _parallel_cases)
