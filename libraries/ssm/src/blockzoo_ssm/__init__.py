"""Numerics shared by the state-space mixers (documented in docs/ssm.md): one copy, used by every Mamba plugin.

    from blockzoo_ssm import causal_conv1d, gated_rms_norm, ssd_scan, selective_scan

`convolved_ssd_scan` (the Mamba 2 convolution and scan in one, the convolution recomputed in the backward pass
on the GPU kernels), and their versions over one slice of longer sequences (micro-sequences, sequence-data
parallelism), which take the previous slice's carry and return the next one's: `causal_conv1d_slice`,
`ssd_scan_slice`, `selective_scan_slice`
(`SSMCarry` holds a mixer's carry; the exchanges over a sequence-data group are in `blockzoo_ssm.state_passing`).
`SSMState` is the mixers' generation state; `GroupMajorDims` the SSD mixers' tensor-parallel layout of heads and
groups.

All work on packed documents (`blockzoo.api.Batch`), never carrying state across a document boundary, and have a
torch path that runs anywhere; on CUDA the scans take GPU kernels (mamba_ssm's Triton SSD kernel when it is
installed, the project's own Triton selective scan). `import_mamba_ssm` / `mamba_ssm_available` are the one place
that imports mamba_ssm.

The configs the mixers share (the initialization types `dt_bias`, `a_log_range`, `a_log_state`, and
`ConvolutionConfig`, whose layer is `CausalConvolution`, and the checks `check_head_groups`,
`check_groups_tensor_parallel`) are importable from here without torch; the functions
load torch on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

from blockzoo_ssm.config import (
    ALogRangeInitializationConfig,
    ALogStateInitializationConfig,
    ConvolutionConfig,
    DtBiasInitializationConfig,
    check_groups_tensor_parallel,
    check_head_groups,
)

# name -> module that defines it; imported on first access (these need torch).
_LAZY = {
    "causal_conv1d": "blockzoo_ssm.conv",
    "convolved_ssd_scan": "blockzoo_ssm.conv_scan",
    "ScanLayout": "blockzoo_ssm.conv_scan",
    "CausalConvolution": "blockzoo_ssm.layers",
    "GroupMajorDims": "blockzoo_ssm.dims",
    "SSMState": "blockzoo_ssm.generation",
    "gated_rms_norm": "blockzoo_ssm.norm",
    "ssd_scan": "blockzoo_ssm.scan",
    "selective_scan": "blockzoo_ssm.scan",
    "SSMCarry": "blockzoo_ssm.slices",
    "causal_conv1d_slice": "blockzoo_ssm.slices",
    "ssd_scan_slice": "blockzoo_ssm.slices",
    "selective_scan_slice": "blockzoo_ssm.slices",
    "import_mamba_ssm": "blockzoo_ssm.kernels",
    "mamba_ssm_available": "blockzoo_ssm.kernels",
    "missing_kernels_advice": "blockzoo_ssm.kernels",
}

__all__ = [
    "ALogRangeInitializationConfig",
    "ALogStateInitializationConfig",
    "ConvolutionConfig",
    "DtBiasInitializationConfig",
    "check_groups_tensor_parallel",
    "check_head_groups",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'blockzoo_ssm' has no attribute {name!r}")
