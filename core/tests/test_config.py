"""The config machinery: structuring, errors with paths, YAML, overrides, explicit fields, updates."""

import textwrap
import types

import pytest

from blockzoo import config
from blockzoo.api import MixerConfig, configclass, field, hookimpl
from blockzoo.config import ConfigError
from blockzoo.distributed.config import DistributedConfig
from blockzoo.layers.config import (
    FillInitializationConfig,
    LayerNormalizationConfig,
    LinearConfig,
    NormalInitializationConfig,
    ParameterConfig,
    RMSNormalizationConfig,
)
from blockzoo.model.config import DecoderBlockConfig, FixedBlockSequenceConfig, PatternBlockSequenceConfig
from blockzoo.plugins import register_plugin
from blockzoo.run_config import RunConfig


@configclass
class ToyMixerConfig(MixerConfig):
    heads: int = field(4)
    window: int | None = field(None)
    linear: LinearConfig = field(factory=LinearConfig)


@configclass
class OtherMixerConfig(MixerConfig):
    state_size: int = field(16)


@hookimpl
def _register_mixers(register):
    register("demo.toy", ToyMixerConfig)
    register("demo.other", OtherMixerConfig)


@pytest.fixture
def demo_plugin(fresh_registry):
    register_plugin(types.SimpleNamespace(register_mixers=_register_mixers), "demo")


# A block the core alone can build (the default mixer and MLP types come from plugins).
EMPTY_BLOCK = {"mixer": {"type": "none"}, "mlp": {"type": "none"}}
EMPTY_DECODER = {"block": EMPTY_BLOCK}


def errors_of(data, cls=RunConfig) -> dict[str, str]:
    with pytest.raises(ConfigError) as caught:
        config.structure(data, cls)
    return dict(caught.value.errors)


def hybrid(**mixer) -> dict:
    return {
        "model": {
            "hidden_size": 64,
            "decoder": {
                "type": "pattern",
                "pattern": ["toy", "plain"],
                "num_blocks": 3,
                "blocks": {
                    "toy": {"mixer": {"type": "demo.toy", **mixer}, "mlp": {"type": "none"}},
                    "plain": {"mixer": {"type": "demo.other"}, "mlp": {"type": "none"}},
                },
            },
        }
    }


def test_polymorphic_fields_resolve_through_the_registry(demo_plugin):
    run = config.structure(hybrid(heads=8, linear={"bias": {"enabled": True}}), RunConfig)
    decoder = run.model.decoder
    assert isinstance(decoder, PatternBlockSequenceConfig)
    assert [name for name, _ in decoder.expanded_blocks()] == ["toy", "plain", "toy"]
    toy = decoder.blocks["toy"]
    assert isinstance(toy, DecoderBlockConfig)
    assert isinstance(toy.mixer, ToyMixerConfig) and toy.mixer.heads == 8
    assert toy.mixer.linear.bias.enabled is True
    assert isinstance(decoder.blocks["plain"].mixer, OtherMixerConfig)
    # Absent `type` keys take each kind's default: `fixed` sequence, `decoder` block, `rms_norm`, `normal` init.
    assert isinstance(toy.normalization, RMSNormalizationConfig)
    init = config.structure({"initialization": {"std": 0.5}}, ParameterConfig).initialization
    assert init == NormalInitializationConfig(std=0.5)


def test_round_trip_through_dict_and_yaml(demo_plugin):
    run = config.structure(hybrid(heads=2, window=16), RunConfig)
    assert config.structure(config.to_dict(run), RunConfig) == run
    assert config.structure(config.to_dict(run, explicit_only=True), RunConfig) == run
    import yaml

    assert config.structure(yaml.safe_load(config.to_yaml(run)), RunConfig) == run


def test_default_config_serializes_to_an_empty_update():
    assert config.to_dict(DistributedConfig(), explicit_only=True) == {}
    assert config.to_dict(config.structure({}, DistributedConfig), explicit_only=True) == {}


def test_errors_name_the_full_path(demo_plugin):
    data = hybrid(heads="many", windw=3)
    data["model"]["decoder"]["blocks"]["plain"]["mixer"]["type"] = "demo.othr"
    data["distributed"] = {"compute_dtype": "fp64", "tensor_parallel": 2.5}
    errors = errors_of(data)
    assert errors["model.decoder.blocks.toy.mixer.heads"] == "expected an integer, got 'many' (str)"
    assert "did you mean 'window'" in errors["model.decoder.blocks.toy.mixer.windw"]
    unknown = errors["model.decoder.blocks.plain.mixer.type"]
    assert "unknown mixer type 'demo.othr'" in unknown and "did you mean 'demo.other'" in unknown
    assert "demo.toy" in unknown  # lists what is available
    assert "expected one of 'fp32', 'bf16'" in errors["distributed.compute_dtype"]
    assert "expected an integer" in errors["distributed.tensor_parallel"]


def test_validation_errors_point_to_the_field():
    errors = errors_of({"model": {"hidden_size": 0, "decoder": EMPTY_DECODER}})
    assert errors == {"model.hidden_size": "must be >= 1, got 0"}
    bad_init = {"initialization": {"type": "uniform", "low": 1.0, "high": 0.5}}
    errors = errors_of({"model": {"decoder": EMPTY_DECODER, "head": {"output_weight": bad_init}}})
    assert errors == {"model.head.output_weight.initialization.high": "must be >= low (1.0), got 0.5"}
    pattern = {"type": "pattern", "pattern": ["a", "b"], "blocks": {"a": EMPTY_BLOCK}}
    assert errors_of({"model": {"decoder": pattern}}) == {
        "model.decoder.pattern.1": "no block named 'b' in `blocks` (defined: a)"
    }
    unused = {"type": "pattern", "pattern": ["a"], "blocks": {"a": EMPTY_BLOCK, "z": EMPTY_BLOCK}}
    assert "never used" in errors_of({"model": {"decoder": unused}})["model.decoder.blocks.z"]


def test_missing_plugin_type_says_what_to_install(core_only_registry):
    # The default mixer type is `attention`; without its plugin the error says where it comes from.
    message = errors_of({"model": {"decoder": {"block": {"mlp": {"type": "none"}}}}})["model.decoder.block.mixer.type"]
    assert "default mixer type" in message and "blockzoo-attention" in message
    message = errors_of({"model": {"decoder": {"block": {"mixer": {"type": "acme.conv"}}}}})
    assert "No installed plugin is named 'acme'" in message["model.decoder.block.mixer.type"]


def test_strict_scalars():
    assert errors_of({"tensor_parallel": True}, DistributedConfig) == {
        "tensor_parallel": "expected an integer, got True (bool)"
    }
    assert errors_of({"sequence_tensor_parallel": "yes"}, DistributedConfig) == {
        "sequence_tensor_parallel": "expected true or false, got 'yes' (str)"
    }
    # YAML reads `1e-5` as a string: float fields accept numeric strings.
    assert config.structure({"epsilon": "1e-5"}, RMSNormalizationConfig).epsilon == 1e-5
    assert errors_of({"epsilon": "tiny"}, RMSNormalizationConfig) == {"epsilon": "expected a number, got 'tiny' (str)"}


def test_type_of_the_wrong_kind_is_refused(demo_plugin):
    assert "unknown normalization type 'demo.toy'" in errors_of({"type": "demo.toy"}, LayerNormalizationConfig)["type"]
    message = errors_of({"type": "rms_norm"}, LayerNormalizationConfig)["type"]
    assert "a LayerNormalizationConfig is expected here" in message


def test_overrides_are_typed():
    changes = config.parse_overrides(
        [
            "model.hidden_size=512",
            "model.embeddings.position_embeddings=true",
            "distributed.timeout=1.5e+2",
            "model.decoder.pattern=[a, b]",
            "model.head.lr_scale=null",
            "distributed.backend=gloo",
        ]
    )
    assert changes == {
        "model": {
            "hidden_size": 512,
            "embeddings": {"position_embeddings": True},
            "decoder": {"pattern": ["a", "b"]},
            "head": {"lr_scale": None},
        },
        "distributed": {"timeout": 150.0, "backend": "gloo"},
    }
    with pytest.raises(ConfigError) as caught:
        config.parse_overrides(["model.hidden_size", "a.b=[1,"])
    paths = dict(caught.value.errors)
    assert "path.to.key=value" in paths["model.hidden_size"]
    assert "cannot parse value" in paths["a.b"]


def test_load_applies_overrides_over_a_file(tmp_path, demo_plugin):
    path = tmp_path / "run.yaml"
    path.write_text(
        textwrap.dedent(
            """
            model:
              hidden_size: 64
              decoder:
                block: {mixer: {type: demo.toy, heads: 8, window: 4}, mlp: {type: none}}
                num_blocks: 2
            """
        )
    )
    run = config.load(RunConfig, path, ["model.decoder.num_blocks=3", "model.decoder.block.mixer.heads=2"])
    assert run.model.hidden_size == 64 and run.model.decoder.num_blocks == 3
    assert run.model.decoder.block.mixer == ToyMixerConfig(heads=2, window=4)
    # Changing a type starts that part from the new type's defaults instead of merging foreign keys.
    run = config.load(RunConfig, path, ["model.decoder.block.mixer.type=demo.other"])
    assert run.model.decoder.block.mixer == OtherMixerConfig()
    with pytest.raises(ConfigError) as caught:
        config.load(RunConfig, path, ["model.decoder.num_blocks=x"])
    assert dict(caught.value.errors) == {"model.decoder.num_blocks": "expected an integer, got 'x' (str)"}


def test_update_keeps_what_was_not_overridden(demo_plugin):
    run = config.structure(hybrid(heads=8), RunConfig)
    assert run.model.decoder.blocks["toy"].mixer.explicit_fields() == {"heads"}
    updated = config.update(run, {"model": {"decoder": {"blocks": {"toy": {"mixer": {"window": 32}}}}}})
    assert updated.model.decoder.blocks["toy"].mixer == ToyMixerConfig(heads=8, window=32)
    assert updated.model.decoder.num_blocks == 3 and updated.model.hidden_size == 64
    # Only explicit fields are written as an update; defaults stay defaults.
    explicit = config.to_dict(updated, explicit_only=True)
    assert "tied_embedding_weight" not in explicit["model"]
    assert explicit["model"]["decoder"]["blocks"]["toy"]["mixer"] == {"type": "demo.toy", "heads": 8, "window": 32}


def test_explicit_fields_of_configs_built_in_python():
    block = config.structure(EMPTY_BLOCK, DecoderBlockConfig)
    assert FixedBlockSequenceConfig(num_blocks=3, block=block).explicit_fields() == {"num_blocks", "block"}
    assert FillInitializationConfig(value=0.0).explicit_fields() == frozenset()
    assert FillInitializationConfig(value=1.0).explicit_fields() == {"value"}


def test_yaml_errors_give_line_and_column(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  hidden_size: [1,\n")
    with pytest.raises(ConfigError) as caught:
        config.load(RunConfig, path)
    assert str(path) in str(caught.value) and "line 3, column 1" in str(caught.value)
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        config.load(RunConfig, path)
    with pytest.raises(ConfigError, match="cannot read the file"):
        config.load(RunConfig, tmp_path / "missing.yaml")
