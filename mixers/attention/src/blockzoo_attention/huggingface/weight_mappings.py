"""The weight mappings of the attention sections: q, k, v and o projections and their biases (each head's channels
reordered for a partial rotary), head norms, and Qwen3-Next's gated query. Torch-free until a tensor is converted."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from blockzoo.api import ComputedWeights, Concatenated, Nested, Weight, WeightMapping
from blockzoo_attention.config import AttentionConfig, PartialRotaryConfig


def _rotary_order(config: AttentionConfig) -> list[int] | None:
    """Partial rotary: blockzoo's channel c of a head is transformers' channel order[c] (None: the same channels).
    transformers rotates channels [0, r) in pairs (j, j + r/2) and passes [r, head_size) through; blockzoo pairs
    (i, i + head_size/2), the first r/2 turning: each half of a blockzoo head is half the turning channels, then
    half the others. The attention scores do not change when queries and keys are permuted alike."""
    if not isinstance(config.rotary, PartialRotaryConfig):
        return None
    size, turning = config.head_size, config.rotary.rotary_size(config.head_size)
    rest = (size - turning) // 2
    return [
        *range(turning // 2),
        *range(turning, turning + rest),
        *range(turning // 2, turning),
        *range(turning + rest, size),
    ]


def _reorder_heads(order: list[int], head_size: int) -> Callable[[Any], Any]:
    """Rows grouped by head (q_proj, k_proj, their biases) with each head's rows taken in `order`."""
    return lambda tensor: tensor.unflatten(0, (-1, head_size))[:, order].flatten(0, 1)


def _query(config: AttentionConfig, suffix: str) -> WeightMapping:
    order = _rotary_order(config)
    if order is None:
        return Weight(f"query.{suffix}", f"q_proj.{suffix}")
    to_ours, to_theirs = _reorder_heads(order, config.head_size), _reorder_heads(_inverse(order), config.head_size)
    return ComputedWeights(
        (f"query.{suffix}",),
        (f"q_proj.{suffix}",),
        import_=lambda tensors: [to_ours(tensors[0])],
        export=lambda tensors: [to_theirs(tensors[0])],
    )


def _key_value(config: AttentionConfig, suffix: str) -> WeightMapping:
    order = _rotary_order(config)
    if order is None:
        return Concatenated(f"key_value.{suffix}", (f"k_proj.{suffix}", f"v_proj.{suffix}"))
    to_ours, to_theirs = _reorder_heads(order, config.head_size), _reorder_heads(_inverse(order), config.head_size)

    def import_(tensors: list[Any]) -> list[Any]:
        import torch

        return [torch.cat([to_ours(tensors[0]), tensors[1]])]

    def export(tensors: list[Any]) -> list[Any]:
        key, value = tensors[0].chunk(2)
        return [to_theirs(key), value.contiguous()]

    return ComputedWeights(
        (f"key_value.{suffix}",), (f"k_proj.{suffix}", f"v_proj.{suffix}"), import_=import_, export=export
    )


def _gated_query(config: AttentionConfig, suffix: str) -> WeightMapping:
    """Qwen3-Next's gated attention: `q_proj` holds, head by head, the head's query rows then its gate rows."""
    size, order = config.head_size, _rotary_order(config)

    def import_(tensors: list[Any]) -> list[Any]:
        heads = tensors[0].unflatten(0, (-1, 2 * size))
        query, gate = heads[:, :size].flatten(0, 1), heads[:, size:].flatten(0, 1)
        return [query if order is None else _reorder_heads(order, size)(query), gate]

    def export(tensors: list[Any]) -> list[Any]:
        import torch

        query, gate = tensors
        query = query if order is None else _reorder_heads(_inverse(order), size)(query)
        return [torch.cat([query.unflatten(0, (-1, size)), gate.unflatten(0, (-1, size))], dim=1).flatten(0, 1)]

    return ComputedWeights(
        (f"query.{suffix}", f"output_gate.{suffix}"), (f"q_proj.{suffix}",), import_=import_, export=export
    )


def _inverse(order: list[int]) -> list[int]:
    inverse = [0] * len(order)
    for position, channel in enumerate(order):
        inverse[channel] = position
    return inverse


def _head_norm(config: AttentionConfig, role: str, theirs: str, offset: float | None) -> WeightMapping | Nested:
    """A head norm under `theirs`: by the format's norm section (Nested); or here, when a partial rotary reorders
    the head's channels (the norm's weight is reordered alike) or the format scales by (offset + w) (Qwen3-Next's
    (1 + w): blockzoo's weight is offset + w, computed in fp32)."""
    order = _rotary_order(config)
    if order is None and offset is None:
        return Nested(role, getattr(config, role), theirs)
    to_ours = (lambda tensor: tensor) if order is None else (lambda tensor: tensor[order])
    to_theirs = (lambda tensor: tensor) if order is None else (lambda tensor: tensor[_inverse(order)])
    shift = offset or 0.0
    return ComputedWeights(
        (f"{role}.weight",),
        (f"{theirs}.weight",),
        import_=lambda tensors: [to_ours(tensors[0].float().add(shift).to(tensors[0].dtype))],
        export=lambda tensors: [to_theirs(tensors[0]).float().sub(shift).to(tensors[0].dtype)],
    )


def _weights(config: AttentionConfig, norm_offset: float | None = None) -> list[WeightMapping | Nested]:
    query = _query if config.output_gate is None else _gated_query
    mappings: list[WeightMapping | Nested] = [
        query(config, "weight"),
        _key_value(config, "weight"),
        Weight("dense.weight", "o_proj.weight"),
    ]
    if config.has_bias(config.query):
        mappings.append(query(config, "bias"))
    if config.has_bias(config.key):
        mappings.append(_key_value(config, "bias"))
    if config.has_bias(config.dense):
        mappings.append(Weight("dense.bias", "o_proj.bias"))
    if config.query_norm is not None:
        mappings.append(_head_norm(config, "query_norm", "q_norm", norm_offset))
    if config.key_norm is not None:
        mappings.append(_head_norm(config, "key_norm", "k_norm", norm_offset))
    return mappings
