"""The plugin's hooks: registers the lm-evaluation-harness backend as benchmark type `lm_eval`. Torch-free."""

from blockzoo.api import PluginInfo, hookimpl
from blockzoo_lm_eval.config import LmEvalConfig


@hookimpl
def plugin_info() -> PluginInfo:
    return PluginInfo(description="lm-evaluation-harness tasks on blockzoo models, in memory, tensor or data parallel")


@hookimpl
def register_components(register) -> None:
    register("lm_eval", LmEvalConfig, "blockzoo_lm_eval.benchmark:LmEvalBenchmark")


@hookimpl
def check_environment() -> list[str]:
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        return ["lm-evaluation-harness is not installed: pip install 'lm-eval>=0.4'"]
    return []
