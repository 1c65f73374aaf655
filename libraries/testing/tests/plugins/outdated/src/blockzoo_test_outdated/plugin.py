from typing import ClassVar

from blockzoo.api import SEQUENCE_DATA_PARALLEL, MixerConfig, PluginInfo, configclass, hookimpl


@configclass
class RetentionConfig(MixerConfig):
    """Claims slices of sequences (plugin API 1.1) from a plugin written for 1.0."""

    capabilities: ClassVar[frozenset[str]] = frozenset({SEQUENCE_DATA_PARALLEL})


@hookimpl
def plugin_info():
    return PluginInfo(api_version=(1, 0), capabilities=(SEQUENCE_DATA_PARALLEL,), description="an outdated claim")


@hookimpl
def register_mixers(register):
    register("outdated.retention", RetentionConfig, "blockzoo_test_outdated.plugin:Nothing")
