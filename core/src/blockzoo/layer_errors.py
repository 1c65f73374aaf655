"""Which plugin layer an error came from: found from the error's traceback (no cost while nothing fails), so the CLI
can say "the mixer 'acme.shift' of plugin 'acme' (blockzoo-test-acme 0.3.1) at decoder.3.mixer raised ..." instead
of printing a traceback of the engine's frames.

A layer is located at build time by the engine's `build_part` frame (its `name` and `config`), at run time by the
innermost frame whose `self` is a module of a registered implementation (its path: the outermost module of the
traceback that holds it, the model). A layer whose output has the wrong shape is named by `LayerOutputError`, which
the block raises before adding the output to the residual stream.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any

import attrs

from blockzoo.plugins import TypeEntry, describe_error, get_registry


class LayerOutputError(ValueError):
    """A mixer or MLP returned a tensor of another shape than its input (the residual stream's)."""

    def __init__(self, layer: Any, shape: tuple[int, ...], expected: tuple[int, ...]):
        self.layer = layer
        super().__init__(f"returned a tensor of shape {tuple(shape)}, expected {tuple(expected)} (its input's shape)")


@attrs.frozen
class LayerFailure:
    """An error raised by (or blamed on) the layer of a plugin type."""

    entry: TypeEntry
    path: str
    stage: str  # "building" or "running"
    error: BaseException

    def message(self) -> str:
        entry = self.entry
        return (
            f"the {entry.kind} {entry.name!r} of plugin {entry.plugin.label} at {self.path} failed while {self.stage}: "
            f"{describe_error(self.error)}{_compile_hint(self.error)}"
        )


def _compile_hint(error: BaseException) -> str:
    """What to try when the error is torch.compile's (`training.compile`), not the layer's: a run killed while
    compiling leaves a half-written file in torch's compile cache, and every later run fails on it ("file too
    short")."""
    exceptions = sys.modules.get("torch._dynamo.exc")  # loaded by whatever compiled
    if exceptions is None or not isinstance(error, exceptions.BackendCompilerFailed):
        return ""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return (
        f"; this is torch.compile failing, not the layer: if a run was stopped while compiling, its cache "
        f"({cache_dir()}) may hold a half-written file: remove that directory and run again, or train without "
        "compiling (training.compile=none)"
    )


def locate_layer_failure(error: BaseException) -> LayerFailure | None:
    """The plugin layer `error` was raised in (or blamed on), else None (an error of the engine itself)."""
    try:
        registry = get_registry(strict=False)
    except Exception:  # noqa: BLE001 - no registry, no plugin to blame
        return None
    by_config = {entry.config_class: entry for entry in registry.entries()}
    by_implementation = {entry.implementation: entry for entry in registry.entries() if entry.implementation}
    frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
    culprit = error.layer if isinstance(error, LayerOutputError) else None
    for frame in reversed(frames):  # innermost first
        if frame.f_code.co_name == "build_part" and frame.f_globals.get("__name__") == "blockzoo.model.block":
            entry = by_config.get(type(frame.f_locals.get("config")))
            if entry is not None:
                return LayerFailure(entry=entry, path=str(frame.f_locals.get("name")), stage="building", error=error)
        if culprit is None:
            candidate = frame.f_locals.get("self")
            if _implementation_entry(candidate, by_implementation) is not None:
                culprit = candidate
    if culprit is None:
        return None
    entry = _implementation_entry(culprit, by_implementation)
    if entry is None:
        return None
    return LayerFailure(entry=entry, path=_path_of(culprit, frames), stage="running", error=error)


def _implementation_entry(candidate: Any, by_implementation: dict[str, TypeEntry]) -> TypeEntry | None:
    """The registry entry whose implementation `candidate` is an instance of (FSDP makes a subclass of each class)."""
    if candidate is None or not hasattr(candidate, "named_modules"):
        return None
    for cls in type(candidate).__mro__:
        if (entry := by_implementation.get(f"{cls.__module__}:{cls.__qualname__}")) is not None:
            return entry
    return None


def _path_of(layer: Any, frames: list) -> str:
    """The layer's module path in the outermost module of the traceback that holds it (e.g. `decoder.3.mixer`)."""
    for frame in frames:  # outermost first
        owner = frame.f_locals.get("self")
        if owner is layer or not hasattr(owner, "named_modules"):
            continue
        for name, module in owner.named_modules():
            if module is layer:
                return name
    return f"a {type(layer).__name__} layer"
