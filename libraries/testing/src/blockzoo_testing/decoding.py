"""Generation against the full forward: `check_decoding` feeds sequences step by step (a prefill, then chunks, then one
token at a time) to a layer's state and compares what it gives with the full forward of a reference layer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from blockzoo.layers.base import Batch, Layer, Mixer
from blockzoo_testing.runs import ConformanceError, layer_inputs, mismatch

# Two sequences decoded from a prefill of different lengths, then a chunk of several tokens, then one at a time.
DECODING_LENGTHS = (6, 4)
DECODING_STEPS = ((3, 2), (2, 1), (1, 1))
DECODING_FIX = (
    "new_state(...) must hold all that forward needs from earlier tokens (KV cache, convolution window, recurrent "
    "state), and forward(hidden, batch, state) with batch.past_lengths set must read it and append the batch's tokens "
    "(document i of the batch is sequence i of the state)."
)


def check_decoding(
    layer: Layer,
    *,
    tolerance: Mapping[str, float],
    lengths: Sequence[int] = DECODING_LENGTHS,
    steps: Sequence[Sequence[int]] = DECODING_STEPS,
    reference: Layer | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> None:
    """Generating with `layer` equals the full forward of `reference` (default: `layer` itself): sequences of `lengths`
    tokens, fed in `steps` (step i gives sequence j `steps[i][j]` tokens; the first step is the prefill) to a state
    from `new_state`, in `dtype`."""
    reference = layer if reference is None else reference
    problems = decoding_problems(layer, reference, tolerance, lengths, steps, dtype, seed)
    if problems:
        raise ConformanceError("\n".join([*problems, DECODING_FIX]))


def decoding_problems(
    layer: Layer,
    reference: Layer,
    tolerance: Mapping[str, float],
    lengths: Sequence[int],
    steps: Sequence[Sequence[int]],
    dtype: torch.dtype,
    seed: int,
) -> list[str]:
    """What `check_decoding` finds: for each sequence that differs, the first step that does (else the whole)."""
    if [sum(step[index] for step in steps) for index in range(len(lengths))] != list(lengths):
        raise ValueError(f"the decoding steps {steps} do not add up to the sequences' lengths {list(lengths)}")
    hidden = layer_inputs(sum(lengths), layer.hidden_dim.global_size, seed)[0].to(dtype)
    reference_device, device = reference.distributed.device, layer.distributed.device
    with torch.no_grad():
        expected = reference(hidden.to(reference_device), Batch(lengths, device=reference_device)).split(lengths)
    state = layer.new_state(len(lengths), max(lengths), device, dtype) if isinstance(layer, Mixer) else None
    sequences, past = hidden.to(device).split(lengths), [0] * len(lengths)
    decoded: list[list[tuple[int, int, torch.Tensor]]] = [[] for _ in lengths]  # Per sequence: (step, start, output).
    for number, step in enumerate(steps):
        chunk = torch.cat([sequence[start : start + count] for sequence, start, count in zip(sequences, past, step)])
        with torch.no_grad():
            output = layer(chunk, Batch(step, past_lengths=past, device=device), state)
        for index, part in enumerate(output.split(list(step))):
            decoded[index].append((number, past[index], part))
        past = [start + count for start, count in zip(past, step)]
    problems = []
    for index, (parts, wanted) in enumerate(zip(decoded, expected)):
        whole = mismatch(torch.cat([part for *_, part in parts]), wanted, tolerance, f"decoded sequence {index}")
        if whole is None:
            continue
        in_steps = (
            mismatch(
                part,
                wanted[start : start + len(part)],
                tolerance,
                f"decoding step {number} ({len(part)} tokens after {start}) of sequence {index}",
            )
            for number, start, part in parts
        )
        problems.append(f"{next(filter(None, in_steps), whole)} from the full forward")
    return problems
