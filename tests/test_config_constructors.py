"""Configs built in Python check their values as reading YAML does: a value of the wrong type is a
`ConfigFieldError` naming the field, never a raw TypeError from a later comparison, and nothing of the right type
is refused (YAML's own path gives the same message). Cross-distribution: the model's defaults need the first-party
layers."""

import math

import pytest

from blockzoo.config import ConfigError, ConfigFieldError, structure
from blockzoo.layers.config import LinearConfig
from blockzoo.model.config import FixedBlockSequenceConfig, ModelConfig
from blockzoo.training.config import AdamWConfig, TrainingConfig


@pytest.mark.parametrize(
    ("cls", "values", "field", "message"),
    [
        (ModelConfig, {"hidden_size": "abc"}, "hidden_size", "expected an integer, got 'abc' (str)"),
        (ModelConfig, {"hidden_size": True}, "hidden_size", "expected an integer, got True (bool)"),
        (ModelConfig, {"hidden_size": 8.5}, "hidden_size", "expected an integer, got 8.5 (float)"),
        (ModelConfig, {"hidden_size": 8.0}, "hidden_size", "expected an integer, got 8.0 (float)"),
        (AdamWConfig, {"learning_rate": "1e-3"}, "learning_rate", "expected a number, got '1e-3' (str)"),
        (AdamWConfig, {"learning_rate": math.nan}, "learning_rate", "expected a number, got nan (not a number)"),
        (TrainingConfig, {"compile": "everything"}, "compile", "expected one of 'none', 'blocks'; got 'everything'"),
        (ModelConfig, {"decoder": {"num_blocks": 2}}, "decoder", "expected a FixedBlockSequenceConfig, got {"),
        (FixedBlockSequenceConfig, {"num_blocks": None}, "num_blocks", "expected an integer, got null"),
        (LinearConfig, {"lr_scale": [1.0]}, "lr_scale", "expected a number, got [1.0] (list)"),
    ],
)
def test_a_value_of_the_wrong_type_names_its_field(cls, values, field, message):
    with pytest.raises(ConfigFieldError) as caught:
        cls(**values)
    assert caught.value.field_name == field
    assert message in caught.value.message


def test_yaml_names_the_same_problem():
    with pytest.raises(ConfigError) as caught:
        structure({"hidden_size": "abc"}, ModelConfig)
    assert caught.value.errors == [("hidden_size", "expected an integer, got 'abc' (str)")]


def test_values_of_the_right_type_are_kept():
    model = ModelConfig(hidden_size=64, decoder=FixedBlockSequenceConfig(num_blocks=3))
    assert model.hidden_size == 64 and model.decoder.num_blocks == 3
    assert AdamWConfig(learning_rate=1).learning_rate == 1  # an int where a number is asked for
    assert structure({"hidden_size": 64}, ModelConfig) == ModelConfig(hidden_size=64)


def test_building_a_model_larger_than_the_memory_names_the_config_as_train_does():
    import blockzoo

    too_large = {
        "hidden_size": 65536,
        "embeddings": {"vocab_size": 1_000_000},
        "decoder": {"num_blocks": 1, "block": {"mixer": {"type": "none"}, "mlp": {"type": "none"}}},
    }
    with pytest.raises(ConfigError) as caught:
        blockzoo.build({"model": too_large})
    ((path, message),) = caught.value.errors
    assert path == "model"
    assert "its parameters alone take 488.3 GiB on this rank, more than this machine's cpu memory" in message


@pytest.mark.parametrize("kind", ["mixer", "mlp"])
def test_a_layer_base_class_guessed_for_a_layer_names_the_types_to_build(kind):
    from blockzoo.api import MixerConfig, MLPConfig

    base = {"mixer": MixerConfig, "mlp": MLPConfig}[kind]
    with pytest.raises(TypeError) as caught:
        base()
    assert f"{base.__name__} is the base class of the configs of every {kind} type" in str(caught.value)
    assert f"none: blockzoo.layers.config.No{'Mixer' if kind == 'mixer' else 'MLP'}Config" in str(caught.value)


def test_a_layer_asking_for_too_much_memory_while_built_names_its_place():
    from blockzoo.preflight import model_on_meta_device
    from blockzoo.run_config import RunConfig

    block = {"mixer": {"type": "attention", "heads": 4, "head_groups": 2, "head_size": 2**45}, "mlp": {"type": "none"}}
    config = structure({"model": {"hidden_size": 128, "decoder": {"num_blocks": 1, "block": block}}}, RunConfig)
    with pytest.raises(ConfigError) as caught:
        model_on_meta_device(config)  # what `blockzoo config` and `train` build first
    ((path, message),) = caught.value.errors
    assert path == "model"
    assert message.startswith("cannot be built: the mixer at decoder.0.mixer asks for 131,072.0 GiB of memory")
    assert "Error" not in message
