"""Every rank must run the same thing: the same blockzoo, torch and plugins (distributions, versions, statuses) and
the same resolved run config. `check_ranks_agree` compares them once at start and refuses a run whose ranks differ.

Each rank hashes a description of what it runs and the hashes are all-gathered (one small collective). Only when
they differ are the descriptions themselves exchanged, as UTF-8 bytes (no pickle): rank 0's and that of the first
rank that differs from it. Every rank then raises the same `UsageError`, naming that rank and what differs.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from blockzoo.config import Config, to_dict
from blockzoo.distributed.runtime import Distributed
from blockzoo.errors import UsageError
from blockzoo.plugins import get_registry

# Lines of the config difference shown (the first ones: the difference that matters is usually the first).
DIFF_LINES = 12


def describe_rank(run_config: Config) -> dict[str, Any]:
    """What this process runs: versions, plugins, and the resolved run config as `path: value` lines."""
    from blockzoo import __version__

    plugins = {}
    for key, record in get_registry().plugins.items():
        origin = f"{record.distribution} {record.version}" if record.distribution else "registered in-process"
        status = record.status if record.status != "disabled" else f"disabled: {record.error}"
        plugins[key] = f"{origin} ({status})"
    return {
        "blockzoo": __version__,
        "torch": torch.__version__,
        "plugins": dict(sorted(plugins.items())),
        "config": list(_config_lines(to_dict(run_config))),
    }


def _config_lines(value: Any, path: str = "") -> Iterator[str]:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            yield from _config_lines(item, f"{path}.{key}" if path else str(key))
    else:
        yield f"{path}: {json.dumps(value, sort_keys=True, default=str)}"


def check_ranks_agree(run_config: Config, distributed: Distributed) -> None:
    """Raise `UsageError` on every rank unless all ranks of the world run the same blockzoo, torch, plugins and
    resolved `run_config`. Call on every rank at start, once the process group exists (a single process passes)."""
    if distributed.world_size == 1 or not dist.is_initialized():
        return
    text = json.dumps(describe_rank(run_config), sort_keys=True)
    digest = torch.tensor(
        [int.from_bytes(part, "little", signed=True) for part in _chunks(hashlib.sha256(text.encode()).digest(), 8)],
        dtype=torch.int64,
        device=distributed.device,
    )
    digests = [torch.empty_like(digest) for _ in range(dist.get_world_size())]
    dist.all_gather(digests, digest)
    differing = [rank for rank, other in enumerate(digests) if not torch.equal(other, digests[0])]
    if not differing:
        return
    rank = differing[0]
    reference = json.loads(_broadcast_text(text, 0, distributed.device))
    other = json.loads(_broadcast_text(text, rank, distributed.device))
    raise UsageError(
        f"rank {rank} does not run what rank 0 runs (every rank needs the same blockzoo, torch, plugins and run "
        f"config):\n  " + "\n  ".join(describe_difference(reference, other, rank))
    )


def _chunks(data: bytes, size: int) -> list[bytes]:
    return [data[start : start + size] for start in range(0, len(data), size)]


def _broadcast_text(text: str, source: int, device: torch.device) -> str:
    """Rank `source`'s `text`, on every rank."""
    data = text.encode()
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=source)
    if dist.get_rank() == source:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buffer = torch.empty(int(length), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=source)
    return bytes(buffer.cpu().tolist()).decode()


def describe_difference(reference: dict[str, Any], other: dict[str, Any], rank: int) -> list[str]:
    """What differs between rank 0's description (`reference`) and rank `rank`'s, one line each."""
    lines = []
    for name in ("blockzoo", "torch"):
        if reference[name] != other[name]:
            lines.append(f"{name} {reference[name]} on rank 0, {other[name]} on rank {rank}")
    for plugin in sorted(reference["plugins"].keys() | other["plugins"].keys()):
        ours, theirs = reference["plugins"].get(plugin), other["plugins"].get(plugin)
        if ours != theirs:
            lines.append(
                f"plugin {plugin!r}: {ours or 'absent'} on rank 0, {theirs or 'absent'} on rank {rank}"
                + ("; see BLOCKZOO_PLUGINS and BLOCKZOO_DISABLE_PLUGINS" if "disabled" in f"{ours}{theirs}" else "")
            )
    if reference["config"] != other["config"]:
        diff = list(
            difflib.unified_diff(reference["config"], other["config"], "rank 0", f"rank {rank}", n=0, lineterm="")
        )
        shown = [line for line in diff if not line.startswith("@@")]
        lines.append("the run configs differ:")
        lines += [f"  {line}" for line in shown[:DIFF_LINES]]
        if len(shown) > DIFF_LINES:
            lines.append(f"  ... ({len(shown) - DIFF_LINES} more lines)")
    return lines
