"""The random states a run keeps, saved with its checkpoints so that a resumed run draws what the straight run drew.

Every rank's: torch's global CPU generator and, on a GPU, the device's (what a layer drawing in forward without a
generator of its own uses, e.g. dropout), and every `torch.Generator` a module of the model keeps as an attribute
(e.g. the MoE router's jitter generator), by `<module name>.<attribute>`. The data pipeline keeps none: its samples
are drawn from generators seeded by (seed, split, index), and its position is in the checkpoint's `data`.

The states are plain bytes in the checkpoint's metadata (`extra.random_states`, one entry per rank), gathered to
rank 0, which writes the metadata. A resume with the same number of ranks restores each rank's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from blockzoo.distributed.runtime import Distributed


def module_generators(model: nn.Module) -> Iterator[tuple[str, torch.Generator]]:
    """Every generator a module of `model` keeps as an attribute, by `<module name>.<attribute>`."""
    for module_name, module in model.named_modules():
        for attribute, value in vars(module).items():
            if isinstance(value, torch.Generator):
                yield f"{module_name}.{attribute}".lstrip("."), value


def _to_bytes(state: torch.Tensor) -> bytes:
    return bytes(state.cpu().numpy().tobytes())


def _to_state(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def random_states(model: nn.Module, distributed: Distributed) -> list[dict[str, Any]]:
    """Every rank's random states (a collective: every rank calls it; the list is complete on every rank)."""
    own: dict[str, Any] = {"torch": _to_bytes(torch.get_rng_state())}
    if distributed.device.type == "cuda":
        own["cuda"] = _to_bytes(torch.cuda.get_rng_state(distributed.device))
    own["generators"] = {name: _to_bytes(generator.get_state()) for name, generator in module_generators(model)}
    if distributed.world_size == 1:
        return [own]
    states: list[Any] = [None] * distributed.world_size
    dist.all_gather_object(states, own)  # plain bytes between our own processes
    return states


def restore_random_states(model: nn.Module, distributed: Distributed, saved: Any) -> str | None:
    """Set this rank's random states from `saved` (what `random_states` returned when the checkpoint was written).
    Returns why they could not be restored (the resumed run then draws other random numbers), or None."""
    if not isinstance(saved, list) or not saved:
        return "the checkpoint holds no random states (written by an older blockzoo)"
    if len(saved) != distributed.world_size:
        return f"the checkpoint holds the random states of {len(saved)} ranks, this run has {distributed.world_size}"
    own = saved[distributed.rank]
    generators = dict(module_generators(model))
    if not isinstance(own, dict) or set(own.get("generators") or {}) != set(generators):
        found = sorted((own.get("generators") or {}) if isinstance(own, dict) else ())
        return f"the checkpoint holds generators {found}, the model has {sorted(generators)}"
    torch.set_rng_state(_to_state(own["torch"]))
    if distributed.device.type == "cuda" and "cuda" in own:
        torch.cuda.set_rng_state(_to_state(own["cuda"]), distributed.device)
    for name, generator in generators.items():
        generator.set_state(_to_state(own["generators"][name]))
    return None
