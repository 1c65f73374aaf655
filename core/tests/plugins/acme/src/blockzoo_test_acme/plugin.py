from blockzoo.api import PluginInfo, hookimpl
from blockzoo_test_acme.config import ShiftMixerConfig


@hookimpl
def plugin_info():
    return PluginInfo(capabilities=("tensor_parallel",), description="a test mixer")


@hookimpl
def register_mixers(register):
    register("acme.shift", ShiftMixerConfig, "blockzoo_test_acme.shift:ShiftMixer")


@hookimpl
def check_environment():
    return []
