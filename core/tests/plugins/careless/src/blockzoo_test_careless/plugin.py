from blockzoo.api import hookimpl
from blockzoo_test_careless.config import CarelessMixerConfig


@hookimpl
def register_mixers(register):
    register("careless.mixer", CarelessMixerConfig, "blockzoo_test_careless.config:CarelessMixerConfig")
