"""Tensor-parallel and sequence-tensor-parallel attention equal the single-process run (outputs and gradients).

One set of gloo processes per world size runs every case; each rank builds the single-process reference itself
from the same seed. Cases cover split head groups (GQA), split heads with replicated key/value (MQA, and fewer
groups than ranks), biases and per-head norms (replicated parameters whose gradients are partial per rank).
"""

import pytest
import torch
from attention_reference import SEED, build, inputs, single_process

from blockzoo.api import Distributed, DistributedConfig
from blockzoo.layers.base import Batch
from blockzoo.testing.distributed import run_distributed

TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}
LENGTHS = [5, 3, 4]  # 12 tokens: sequence-tensor-parallel splits them between 2 or 4 ranks.
RANDOM_BIAS = {"bias": {"initialization": {"type": "normal", "std": 0.5}}}
RANDOM_NORM = {"type": "rms_norm", "weight": {"initialization": {"type": "normal", "mean": 1.0, "std": 0.3}}}
BIASES = {"add_linear_biases": True, "query": RANDOM_BIAS, "key": RANDOM_BIAS, "value": RANDOM_BIAS}
CASES = {
    2: {
        "gqa-norms-qkv-biases": {
            "heads": 4,
            "head_groups": 2,
            "head_size": 8,
            **BIASES,
            "dense": {"bias": {"enabled": False}},
            "query_norm": RANDOM_NORM,
            "key_norm": RANDOM_NORM,
        },
        "mqa-window-llama3": {
            "heads": 4,
            "head_groups": 1,
            "head_size": 8,
            **BIASES,
            "dense": RANDOM_BIAS,
            "window_size": 3,
            "key_norm": RANDOM_NORM,
            "rotary": {"type": "llama3", "theta": 100.0, "original_context_length": 64},
        },
    },
    4: {
        "groups-split": {"heads": 8, "head_groups": 4, "head_size": 4, "query_norm": RANDOM_NORM},
        "fewer-groups-than-ranks": {"heads": 8, "head_groups": 2, "head_size": 4, **BIASES, "key_norm": RANDOM_NORM},
        "mqa": {"heads": 4, "head_groups": 1, "head_size": 8, **BIASES, "query_norm": RANDOM_NORM, "window_size": 2},
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


def _parallel_cases(world_size: int) -> None:
    def layout(**parallel) -> Distributed:
        # The first one starts the process group; the later ones lay out its ranks differently.
        return Distributed(DistributedConfig(seed=SEED, backend="gloo", timeout=60, **parallel))

    with layout(tensor_parallel=world_size) as distributed:
        sequence_parallel = layout(tensor_parallel=world_size, sequence_tensor_parallel=True)
        for name, data in CASES[world_size].items():
            _check_matches(distributed, data, f"TP={world_size} {name}")
            _check_matches(sequence_parallel, data, f"TP={world_size} with sequence-tensor-parallel {name}")
        if world_size == 2:
            _check_decoding_matches(distributed, CASES[2]["mqa-window-llama3"], "TP=2 decoding, MQA")
            _check_decoding_matches(distributed, CASES[2]["gqa-norms-qkv-biases"], "TP=2 decoding, GQA")
        else:
            with pytest.raises(ValueError, match=r"tensor_parallel=4 must divide head_groups \(2\) or the heads of"):
                build({"heads": 4, "head_groups": 2, "head_size": 8}, distributed)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_matches_single_process(world_size):
    run_distributed(world_size, _parallel_cases, world_size)
