"""blockzoo-ssm's hooks: the initializations of the state-space mixers' parameters, for any config that names them
(`dt_bias`, `a_log_range`, `a_log_state`). Config classes only: the torch-side functions load when a layer is built."""

from __future__ import annotations

from blockzoo.api import PluginInfo, hookimpl
from blockzoo_ssm.config import ALogRangeInitializationConfig, ALogStateInitializationConfig, DtBiasInitializationConfig


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo(
        description="the numerics the state-space mixers share (causal convolution, selective and SSD scans, their "
        "Triton kernels) and their parameters' initializations"
    )


@hookimpl
def register_components(register) -> None:
    register("dt_bias", DtBiasInitializationConfig, "blockzoo_ssm.initialization:initialize_dt_bias")
    register("a_log_range", ALogRangeInitializationConfig, "blockzoo_ssm.initialization:initialize_a_log_range")
    register("a_log_state", ALogStateInitializationConfig, "blockzoo_ssm.initialization:initialize_a_log_state")
