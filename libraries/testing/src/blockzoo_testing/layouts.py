"""Packed batches whose slices all continue a document: the layouts `check_sequence_data_parallel` runs by default.

Under sequence-data parallelism (and micro-sequences) a slice needs what the slices before it leave only where a
document goes on across the boundary between them. A batch whose boundaries fall on document starts lets a layer
that passes nothing between its ranks, or combines what it passes wrongly, give the single process's numbers. So
`straddling_lengths(ranks, micro_sequence_length, seed)` makes, seeded, a batch in which:

- no slice boundary is a document start: every slice but the first continues a document begun before it, so every
  rank receives a state from the ranks before it (and with micro-sequences every step from the step before);
- a slice lies wholly inside a document that began before it and goes on after it, so the state it receives passes
  through it (a recurrence's whole-slice decay acts on it): between two ranks of a step when there are three ranks
  or more, and, with micro-sequences, the last slice of the first step, through which the carry to the next step
  passes;
- another slice inside the batch holds a document start (the state from before is cut there, while its own end still
  goes on into the next slice), when there are four slices or more;
- where a slice has room (3 tokens or more), a one-token document sits inside one.

`layout_problems(lengths, ranks, micro_sequence_length)` says which of the first three a batch lacks (empty: it has
them all): the kit's self-tests check the generator with it, and a plugin may check lengths of its own.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from itertools import accumulate, pairwise

# Tokens of a slice without micro-sequences: room for a document start and a one-token document inside a slice.
DEFAULT_SLICE_TOKENS = 4


def straddling_lengths(
    ranks: int, micro_sequence_length: int | None = None, *, seed: int = 0, slice_tokens: int = DEFAULT_SLICE_TOKENS
) -> tuple[int, ...]:
    """Document lengths of a micro-batch split over `ranks` sequence-data ranks in slices of `micro_sequence_length`
    tokens over two steps (None: one slice of `slice_tokens` a rank), with the properties of the module's list."""
    if ranks < 1:
        raise ValueError(f"straddling_lengths: ranks={ranks} must be at least 1")
    size = micro_sequence_length or slice_tokens
    if size < 2:
        raise ValueError(
            f"straddling_lengths: slices of {size} token cannot hold a document start away from their boundaries"
        )
    generator = random.Random(f"{seed}:{ranks}:{micro_sequence_length}:{slice_tokens}")
    count = ranks * (2 if micro_sequence_length else 1)  # Two steps: the carry between them is used.
    inner = list(range(1, count - 1))
    whole = set()
    if micro_sequence_length and ranks < count - 1:
        whole.add(ranks - 1)  # The last slice of the first step: the carry to the next step passes through it.
    if ranks >= 3:
        whole.add(generator.randrange(1, ranks - 1))  # Between two ranks of one step.
    rest = [index for index in inner if index not in whole]
    cut = {generator.choice(rest)} if rest else set()
    for index in rest:
        if index not in cut and generator.random() < 0.5:
            whole.add(index)
    starts = {0}
    single_placed = False
    for index in range(count):
        if index in whole:
            continue
        offsets = list(range(1, size))  # Never the slice's own first token: that boundary stays inside a document.
        chosen = {offset for offset in offsets if generator.random() < 0.3}
        if index in cut and not chosen:
            chosen.add(generator.choice(offsets))
        if not single_placed and size >= 3 and (index in cut or index == count - 1):
            first = generator.randrange(1, size - 1)
            chosen |= {first, first + 1}  # A one-token document.
            single_placed = True
        starts |= {index * size + offset for offset in chosen}
    bounds = [*sorted(starts), count * size]
    return tuple(stop - start for start, stop in pairwise(bounds))


def layout_problems(lengths: Sequence[int], ranks: int, micro_sequence_length: int | None = None) -> list[str]:
    """What the batch of documents `lengths` lacks for a check of sequence-data parallelism over `ranks` ranks (in
    slices of `micro_sequence_length`; None: one slice a rank) to see every state passed between slices: a slice
    boundary that is a document start, no slice wholly inside a document passing a state through, no slice holding
    a document start."""
    tokens = sum(lengths)
    size = micro_sequence_length or tokens // ranks
    if size < 1 or tokens % (ranks * size):
        return [f"{tokens} tokens do not split into slices of {size} over {ranks} ranks"]
    starts = set(accumulate(lengths, initial=0)) - {tokens}
    count = tokens // size
    problems = [
        f"the boundary at token {index * size} (before slice {index}) is a document start"
        for index in range(1, count)
        if index * size in starts
    ]
    inside = [index for index in range(1, count - 1) if not starts & set(range(index * size, (index + 1) * size + 1))]
    needed = []
    if ranks >= 3:
        between = [index for index in inside if index % ranks not in (0, ranks - 1)]
        needed.append(("between two ranks of a step", between))
    if micro_sequence_length and count > ranks:
        step_ends = [index for index in inside if index % ranks == ranks - 1]
        needed.append(("the last slice of a step before another step", step_ends))
    problems += [f"no slice {where} lies wholly inside a continued document" for where, found in needed if not found]
    holding = [starts & set(range(index * size + 1, (index + 1) * size)) for index in range(1, count - 1)]
    if count > 3 and not any(holding):
        problems.append("no slice between the first and the last holds a document start")
    return problems
