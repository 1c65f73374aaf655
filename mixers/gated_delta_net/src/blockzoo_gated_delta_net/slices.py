"""The gated delta rule over one slice of longer sequences (micro-sequences, sequence-data parallelism).

A slice (`Batch` with `sequence_data`) holds pieces of documents; only its first piece may continue a document begun
before it (`batch.continued` tokens earlier), and the state after its last piece is what the next slice continues.

- One slice after another (micro-sequences; no group): the first piece starts from `previous`, the state the slice
  before handed over, when it continues a document.
- Sequence-data parallelism (the slices of a group run at once, one per rank): each rank runs its slice from a zero
  state. Unlike an SSM's, the delta rule's slice map is not a decay: S_end = A_r S_0 + S_r, with A_r a
  [key_size, key_size] matrix per value head (S_0 ↦ Π over the chunks of (e^{b_C} I − (K ⊙ e^{b_C − b})ᵀ W), the
  WY factors' product). A_r is the final state of the rule run from the identity with zero values (the rule is
  linear in (v, S_0) together), and only when the whole slice continues one document (else a document starts in
  it and the state is cut there: A_r = 0). The ranks all-gather their (S_r, A_r), each composes those of the ranks
  before it in order (applied to `previous`): its true initial state; all compose them all: the carry, the same
  on every rank. The first piece's outputs then add the rule's outputs from that initial state with zero values.
  The gather's backward returns each rank's share of the gradients (`blockzoo.api.gather_slices`); a rank that uses
  nothing of it still joins (`depend_on`).
"""

from __future__ import annotations

import torch

from blockzoo.api import Batch, depend_on, gather_slices
from blockzoo_gated_delta_net.delta_rule import gated_delta_rule_from


def gated_delta_rule_slice(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    batch: Batch,
    previous: torch.Tensor | None,
    *,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, the state after the slice [value_heads, key_size, value_size], fp32). `previous`: the state before the
    slice (before the group's first slice under sequence-data parallelism), None at the start of the sequence.
    Inputs as `delta_rule.gated_delta_rule`'s."""
    options = {"chunk_size": chunk_size}
    group = _group_of(batch)
    if group is None:
        initial = None
        if previous is not None and batch.continued:
            rest = previous.new_zeros(batch.num_documents - 1, *previous.shape)
            initial = torch.cat([previous[None], rest])
        output, final = gated_delta_rule_from(q, k, v, g, beta, batch, initial=initial, **options)
        return output, final[-1]

    output, final = gated_delta_rule_from(q, k, v, g, beta, batch, **options)
    heads, key_size = final.shape[1:3]
    if batch.num_documents == 1 and batch.continued:  # the whole slice continues one document: it carries S_0
        identity = torch.eye(key_size, dtype=final.dtype, device=final.device).expand(1, heads, key_size, key_size)
        no_values = v.new_zeros(*v.shape[:2], key_size)
        _, transition = gated_delta_rule_from(q, k, no_values, g, beta, batch, initial=identity, **options)
        transition = transition[0]
    else:
        transition = final.new_zeros(heads, key_size, key_size)
    initial, carry = _states_over_ranks(final[-1], transition, batch, group, previous)
    if not batch.continued:
        return depend_on(output, initial), carry
    # The outputs of the first piece from its true initial state (zero values; the other pieces start from zero).
    first = batch.host_lengths[0]
    first_piece = Batch([first], device=q.device)
    rows = slice(0, first)
    from_initial, _ = gated_delta_rule_from(
        q[rows], k[rows], torch.zeros_like(v[rows]), g[rows], beta[rows], first_piece, initial=initial[None], **options
    )
    dtype = torch.promote_types(output.dtype, torch.float32)
    corrected = torch.cat([output[rows].to(dtype) + from_initial.to(dtype), output[first:].to(dtype)])
    return corrected.to(output.dtype), carry


def _group_of(batch: Batch):
    """The sequence-data group of several ranks the slice belongs to, None without one."""
    sequence_data = batch.sequence_data
    group = None if sequence_data is None else sequence_data.group
    return None if group is None or group.size() == 1 else group


def _states_over_ranks(
    final: torch.Tensor, transition: torch.Tensor, batch: Batch, group, previous: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's initial state, the state after the group's last slice): the slices' maps S ↦ A_r S + S_r
    composed in rank order from `previous` (zeros when None)."""
    pairs = gather_slices(torch.cat([final.flatten(), transition.flatten()])[None], group)
    finals, transitions = pairs.split([final.numel(), transition.numel()], dim=1)
    state = torch.zeros_like(final) if previous is None else previous.to(final.dtype)
    initial = state
    for rank in range(group.size()):
        if rank == batch.sequence_data.rank:
            initial = state
        state = transitions[rank].view(transition.shape) @ state + finals[rank].view(final.shape)
    # The first rank's initial state is `previous`: it keeps the pairs in its graph for the backward collective.
    return depend_on(initial, pairs), state
