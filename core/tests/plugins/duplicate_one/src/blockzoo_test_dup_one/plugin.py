from blockzoo.api import MixerConfig, configclass, hookimpl


@configclass
class DuplicateMixerConfig(MixerConfig):
    pass


@hookimpl
def register_mixers(register):
    register("dup.mixer", DuplicateMixerConfig)
