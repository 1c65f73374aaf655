"""The one place that imports mamba_ssm, and the call into its Triton SSD kernel (`mamba_chunk_scan_combined`).

mamba_ssm 2.3.2's package `__init__` imports its compiled Mamba 1 scan `selective_scan_cuda` unconditionally, so a
Triton-only install (built with MAMBA_SKIP_CUDA_BUILD=TRUE, as on machines where no CUDA extension can be built)
does not import. `import_mamba_ssm` then puts an empty stand-in for that module in `sys.modules` for the duration
of the import only; a real `selective_scan_cuda` is always used when it is there, and nothing is left behind when
mamba_ssm is absent.

Autotuning: mamba_ssm's SSD kernels carry 4 to 11 Triton configs each; benchmarking them all made the first call
take 76 s on an H200. Unless `BLOCKZOO_SSD_AUTOTUNE=full`, each kernel keeps only the configs of middle tile cost
(`small`, the default: 2 per kernel; a number N: N per kernel). The change applies to the whole process. The
results are also cached on disk between runs (Triton's `cache_results`, where the installed triton has it).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import os
import sys
import types
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch

STAND_IN = "selective_scan_cuda"
AUTOTUNE_VARIABLE = "BLOCKZOO_SSD_AUTOTUNE"
SMALL_AUTOTUNE = 2  # configs kept per kernel by default
# The mamba_ssm modules that define the SSD kernels `mamba_chunk_scan_combined` runs (forward and backward).
SSD_MODULES = ("ssd_bmm", "ssd_chunk_state", "ssd_state_passing", "ssd_chunk_scan", "ssd_combined")


def import_mamba_ssm() -> types.ModuleType:
    """Import mamba_ssm (ImportError, with the reason, when it is not installed or does not import)."""
    if "mamba_ssm" in sys.modules:
        return sys.modules["mamba_ssm"]
    if importlib.util.find_spec("mamba_ssm") is None:
        raise ImportError("mamba_ssm is not installed")
    stand_in = None
    try:
        importlib.import_module(STAND_IN)
    except ModuleNotFoundError as error:
        if error.name != STAND_IN:  # the extension exists but something it needs is missing: do not hide that
            raise
        stand_in = sys.modules[STAND_IN] = _stand_in()
    try:
        return importlib.import_module("mamba_ssm")
    finally:
        if stand_in is not None and sys.modules.get(STAND_IN) is stand_in:
            del sys.modules[STAND_IN]


@functools.cache
def mamba_ssm_available() -> bool:
    """Whether mamba_ssm imports (through `import_mamba_ssm`), checked once per process. An install that does not
    import is reported with a warning that says why; the torch paths are used then."""
    try:
        import_mamba_ssm()
    except ImportError as error:
        if importlib.util.find_spec("mamba_ssm") is not None:
            warnings.warn(
                f"mamba_ssm is installed but does not import ({type(error).__name__}: {error}); "
                "blockzoo_ssm uses its torch paths",
                stacklevel=2,
            )
        return False
    return True


def missing_kernels_advice(distribution: str) -> list[str]:
    """A plugin's `check_environment` for the SSD scan: on CUDA without mamba_ssm the scan still runs, on the much
    slower torch path; say so, naming `distribution`'s `kernels` extra."""
    import blockzoo_ssm  # the package's name, the one that code (and tests) replace

    if torch.cuda.is_available() and not blockzoo_ssm.mamba_ssm_available():
        return [
            "CUDA is available but mamba_ssm does not import: the SSD scan takes the slow torch path "
            f"(install the `kernels` extra: pip install '{distribution}[kernels]')"
        ]
    return []


def mamba_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    document_index: torch.Tensor,
    *,
    chunk_size: int,
    D: torch.Tensor | None,
    scale_input: bool,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    initial_state: torch.Tensor | None = None,
    return_final_state: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`ssd_scan` through mamba_ssm's `mamba_chunk_scan_combined`, the packed documents told apart by `seq_idx`.

    The kernel always scales the input by dt; without `scale_input` it is given x / dt instead (dt must then be the
    time step itself: no dt_bias, softplus or limit). With them, the kernel computes the time step
    clamp(softplus(dt + dt_bias)) in fp32 as it reads dt, which may be a bf16 slice of in_proj's output: no copy.
    `initial_state` [heads, head_size, state] enters the first document (the kernel's `initial_states`, which
    `seq_idx` confines to document 0); `return_final_state` also returns the state after the last token (its
    `final_states`, fp32), both differentiable through the kernel's backward.
    """
    if not scale_input and (dt_bias is not None or dt_softplus or tuple(dt_limit) != (0.0, math.inf)):
        raise ValueError("mamba_chunk_scan: without scale_input, dt must be the time step (no dt_bias/softplus/limit)")
    if dt_bias is None and not dt_softplus:
        dt = dt.float()  # dt is the time step (a torch result): its gradient adds up in fp32 as the kernel's does
    skip = None if D is None else D.float()
    states = {"initial_state": initial_state, "return_final_state": return_final_state}
    if not scale_input:
        if skip is not None:  # The kernel's skip would read x / dt: D·x is added here instead.
            output = mamba_chunk_scan(
                x, dt, A, B, C, document_index, chunk_size=chunk_size, D=None, scale_input=False, **states
            )
            y = output[0] if return_final_state else output
            y = (y.float() + (skip if skip.ndim == 2 else skip[:, None]) * x.float()).to(y.dtype)
            return (y, output[1]) if return_final_state else y
        x = (x.float() / dt.unsqueeze(-1)).to(x.dtype)
    seq_idx = document_index.to(device=x.device, dtype=torch.int32)[None]
    # Named only when used: the call without them is the one every mamba_ssm release takes.
    slice_states = {} if initial_state is None else {"initial_states": initial_state.float()[None]}
    if return_final_state:
        slice_states["return_final_states"] = True
    output = _chunk_scan_combined()(
        x[None],
        dt[None],
        A.float(),
        B[None],
        C[None],
        chunk_size,
        D=skip,
        seq_idx=seq_idx,
        dt_bias=dt_bias,
        dt_softplus=dt_softplus,
        dt_limit=tuple(dt_limit),
        **slice_states,
    )
    if return_final_state:
        y, final = output
        return y[0], final[0]
    return output[0]


def mamba_gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor,
    *,
    epsilon: float,
    group_size: int,
    norm_before_gate: bool = False,
) -> torch.Tensor:
    """`gated_rms_norm` through mamba_ssm's fused Triton kernel (forward and backward, statistics in fp32)."""
    import_mamba_ssm()
    from mamba_ssm.ops.triton.layernorm_gated import rmsnorm_fn

    return rmsnorm_fn(x, weight, None, z=gate, eps=epsilon, group_size=group_size, norm_before_gate=norm_before_gate)


@functools.cache
def ssd_combined() -> types.ModuleType:
    """mamba_ssm's `ssd_combined` module (`mamba_chunk_scan_combined`, its forward and backward functions), every SSD
    kernel's autotuning bounded as BLOCKZOO_SSD_AUTOTUNE says: whoever calls the kernels first gets it from here."""
    import_mamba_ssm()
    modules = [importlib.import_module(f"mamba_ssm.ops.triton.{name}") for name in SSD_MODULES]
    limit = autotune_limit()
    if limit is not None:
        restrict_autotuning(modules, limit)
    cache_autotuning(modules)
    return modules[-1]


def _chunk_scan_combined():
    return ssd_combined().mamba_chunk_scan_combined


def autotune_limit(environ: dict[str, str] | None = None) -> int | None:
    """Configs kept per SSD kernel from BLOCKZOO_SSD_AUTOTUNE: None (all) for `full`, else a positive number."""
    value = (os.environ if environ is None else environ).get(AUTOTUNE_VARIABLE, "small").strip().lower()
    if value == "full":
        return None
    if value == "small":
        return SMALL_AUTOTUNE
    if value.isdigit() and int(value) > 0:
        return int(value)
    raise ValueError(f"{AUTOTUNE_VARIABLE}={value!r}: expected 'small' (default), 'full' or a number of configs >= 1")


def restrict_autotuning(modules: Iterable[types.ModuleType], limit: int) -> None:
    """Keep at most `limit` autotune configs in every Triton-autotuned kernel the modules define."""
    for kernel in autotuners(modules):
        if len(kernel.configs) > limit:
            kernel.configs = middle_configs(kernel.configs, limit)


def cache_autotuning(modules: Iterable[types.ModuleType]) -> int:
    """Have every Triton-autotuned kernel the modules define keep its autotuning results on disk, in Triton's cache
    (what `triton.autotune(cache_results=True)` or TRITON_CACHE_AUTOTUNING=1 do): a later process with the same
    triton, GPU, kernel source, configs and tuning key reads the best config instead of benchmarking. Triton skips
    the kernels whose configs carry pre-hooks (it cannot store them): those are still tuned in every process. A
    triton without the option (before 3.4) is left as it is. Returns the number of kernels switched."""
    from triton.runtime.autotuner import Autotuner

    if not hasattr(Autotuner, "check_disk_cache"):
        return 0
    switched = 0
    for kernel in autotuners(modules):
        if not kernel.cache_results:
            kernel.cache_results = True
            switched += 1
    return switched


def autotuners(modules: Iterable[types.ModuleType]) -> list[Any]:
    """The Triton `Autotuner`s the modules define, each once."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import KernelInterface

    found = {}
    for module in modules:
        for kernel in vars(module).values():
            # An autotuned kernel may sit under other wrappers (heuristics); each keeps the next in `fn`.
            while isinstance(kernel, KernelInterface) and not isinstance(kernel, Autotuner):
                kernel = getattr(kernel, "fn", None)
            if isinstance(kernel, Autotuner):
                found[id(kernel)] = kernel
    return list(found.values())


def middle_configs(configs: Sequence[Any], limit: int) -> list[Any]:
    """The `limit` configs in the middle of the list sorted by tile cost (product of the BLOCK_SIZE_* values times
    the pipeline stages): the largest tiles overflow shared memory or waste work on small dims, the smallest leave
    the GPU idle. The configs themselves are kept (with their pre-hooks, which some kernels need)."""
    ordered = sorted(configs, key=_tile_cost)
    start = max(0, (len(ordered) - limit) // 2)
    return ordered[start : start + limit]


def _tile_cost(config: Any) -> int:
    cost = getattr(config, "num_stages", 1) or 1
    for key, value in config.kwargs.items():
        if key.startswith("BLOCK_SIZE"):
            cost *= value
    return cost


def _stand_in() -> types.ModuleType:
    module = types.ModuleType(STAND_IN, "blockzoo's empty stand-in: mamba_ssm was installed without its CUDA scan.")

    def missing(name: str) -> Any:
        raise AttributeError(f"{STAND_IN}.{name}: mamba_ssm's compiled Mamba 1 scan is not installed")

    module.__getattr__ = missing
    return module
