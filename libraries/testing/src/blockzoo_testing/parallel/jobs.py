"""What the parallel checks share: the default batch and tolerance, a checked case, running a check on gloo ranks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from blockzoo.config import Config
from blockzoo_testing.distributed import run_distributed
from blockzoo_testing.runs import ConformanceError

DEFAULT_LENGTHS = (5, 1, 6)  # 12 tokens: sequence-tensor-parallel splits them between 2, 3, 4 or 6 ranks.
DEFAULT_TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


@dataclasses.dataclass(frozen=True)
class CheckedCase:
    name: str
    implementation: Any  # Loaded in the parent: a rank's registry lacks the plugins registered in-process there.
    config: Config
    sequence_tensor_parallel: bool
    generation: bool


def run_checks(world_size: int, check: Callable[[Any], None], job: Any) -> None:
    """`check(job)` on `world_size` gloo ranks; the ranks' findings raised as this call's ConformanceError, not as a
    traceback of a child process."""
    try:
        run_distributed(world_size, check, job)
    except Exception as error:
        marker = f"{ConformanceError.__name__}: "
        message = str(error)
        if marker not in message:
            raise
        raise ConformanceError(message[message.rindex(marker) + len(marker) :].strip()) from None
